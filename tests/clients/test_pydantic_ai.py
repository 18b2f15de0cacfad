"""pydantic-ai, unmodified, with an OpenAI chat model pointed at the real server: the
default tool output (``output_type=`` a model becomes a ``final_result`` tool the model
must call) and an agent whose tool is called before it answers.

pydantic-ai validates every call and, where one does not fit, sends the model a retry
prompt instead of failing: each test checks that the run needed none, so an invalid
first answer fails it as surely as an exception would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Literal

import openai
import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ModelMessage, ModelRequest, RetryPromptPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.clients.tools import SIM_MODEL, Trip, Weather
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture
async def model(sim: ServerProcess) -> AsyncIterator[OpenAIChatModel]:
    """The model for ``await agent.run(...)``, on the test's event loop; its client's
    connections are closed afterwards."""
    provider = OpenAIProvider(base_url=sim.v1, api_key="unused")
    async with provider.client:
        yield OpenAIChatModel(SIM_MODEL, provider=provider)


@pytest.fixture
def sync_model(sim: ServerProcess) -> Iterator[OpenAIChatModel]:
    """The model for ``agent.run_sync(...)``, which runs on the thread's event loop (and
    makes one that nobody closes when there is none): here a loop of the test's own,
    closed afterwards with the client's connections."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    provider = OpenAIProvider(base_url=sim.v1, api_key="unused")
    yield OpenAIChatModel(SIM_MODEL, provider=provider)
    client: openai.AsyncOpenAI = provider.client
    loop.run_until_complete(client.close())
    asyncio.set_event_loop(None)
    loop.close()


def retries(messages: list[ModelMessage]) -> list[RetryPromptPart]:
    """The retry prompts pydantic-ai sent back: one per call it could not accept."""
    return [
        part
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, RetryPromptPart)
    ]


@pytest.mark.parametrize("output_type", [Weather, Trip])
def test_output_type_is_returned_by_the_output_tool(
    sync_model: OpenAIChatModel, output_type: type[Weather] | type[Trip]
) -> None:
    agent = Agent(sync_model, output_type=output_type)
    result = agent.run_sync("Two friends go to Lisbon for five nights, when it is sunny.")
    assert isinstance(result.output, output_type)
    assert retries(result.all_messages()) == []


async def test_an_agent_calls_its_tool_then_answers(model: OpenAIChatModel) -> None:
    agent = Agent(model, instructions="Look the weather up before you answer.")
    asked: list[tuple[str, str]] = []

    @agent.tool
    def get_weather(
        ctx: RunContext[None], city: str, unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """The current weather in a city."""
        asked.append((city, unit))
        return f"18 degrees {unit}, sunny"

    result = await agent.run("What is the weather in Paris, in celsius?")
    assert asked, "the tool was never called"
    assert all(unit in ("celsius", "fahrenheit") for _, unit in asked)
    assert isinstance(result.output, str) and result.output
    messages = result.all_messages()
    assert retries(messages) == []
    returned = [
        part
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]
    assert [part.tool_name for part in returned] == ["get_weather"] * len(asked)


async def test_streamed_output_tool(model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=Weather)
    async with agent.run_stream("What is the weather in Paris, in celsius?") as result:
        output = await result.get_output()
    assert isinstance(output, Weather)
    assert retries(result.all_messages()) == []
