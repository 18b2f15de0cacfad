"""The OpenAI Agents SDK (``openai-agents``), unmodified and with its default model (the
Responses API), runs one agent with one tool against the real server: the model calls
the tool, the SDK runs it and sends its output back, and the agent answers in text (the
sim calls a tool when the last message is the user's and answers after a tool result)."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from tests.clients.tools import SIM_MODEL
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow


def test_an_agent_calls_its_tool_and_answers(sim: ServerProcess) -> None:
    # Imported here: ~1.3 s of CPU, which every pytest-xdist worker would pay collecting.
    from agents import Agent, Runner, function_tool, set_default_openai_client

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    set_default_openai_client(AsyncOpenAI(base_url=sim.v1, api_key="unused", max_retries=0))
    agent = Agent(
        name="Forecaster",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=SIM_MODEL,
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1  # one call, made by the SDK with the model's arguments
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)
