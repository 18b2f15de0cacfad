"""Tool calling with the official ``openai`` client, unmodified, against the real server
(directly, and through a gateway in front of one).

Everything asserted is OpenAI's documented behaviour: calls in ``message.tool_calls``
(``id``, ``type: "function"``, ``function.name``, ``function.arguments`` as JSON text)
with ``finish_reason: "tool_calls"``; streamed as ``delta.tool_calls`` fragments joined
by ``index``; ``tool_choice`` ``required``, a named function, ``auto`` and ``none``; and
the client's own helpers (``parse`` and ``stream`` with ``pydantic_function_tool``),
which fail loudly on anything else.  The sim engine calls a tool under ``auto`` when the
last message is the user's and answers in text after tool results.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.clients.tools import (
    ASK_WEATHER,
    SIM_MODEL,
    TIME_TOOL,
    TOOLS,
    WEATHER_TOOL,
    Weather,
    assemble_streamed_calls,
    check_call,
    tool_result_turn,
)
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.v1, api_key="unused") as client:
        yield client


def calls_of(reply: ChatCompletion, choice: int = 0) -> list[dict[str, Any]]:
    """A non-streamed choice's tool calls, each checked against the tool it names."""
    calls = []
    for call in reply.choices[choice].message.tool_calls or []:
        assert call.type == "function"
        assert call.id
        check_call(call.function.name, call.function.arguments)
        calls.append(
            {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        )
    assert len({call["id"] for call in calls}) == len(calls), "tool call ids repeat"
    return calls


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_required_answers_with_calls_that_fit_their_schemas(
    client: openai.OpenAI, seed: int
) -> None:
    reply = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", seed=seed
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(reply)
    assert not choice.message.content  # null (or empty) when the answer is only calls
    assert reply.usage is not None and reply.usage.completion_tokens > 0


@pytest.mark.parametrize("tool", [WEATHER_TOOL, TIME_TOOL], ids=["get_weather", "get_time"])
def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI, tool: dict[str, Any]) -> None:
    name = tool["function"]["name"]
    reply = client.chat.completions.create(
        model=SIM_MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    calls = calls_of(reply)
    assert calls and {call["name"] for call in calls} == {name}
    # OpenAI itself ends a forced call with "stop"; vLLM with "tool_calls".
    assert reply.choices[0].finish_reason in ("tool_calls", "stop")


def test_none_answers_in_text_although_tools_are_offered(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    choice = reply.choices[0]
    assert not choice.message.tool_calls
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_calls_then_answers_the_tool_results_in_text(client: openai.OpenAI) -> None:
    # tool_choice left out: "auto" whenever tools are offered.
    first = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK_WEATHER, tools=TOOLS, seed=11
    )
    calls = calls_of(first)
    assert calls and first.choices[0].finish_reason == "tool_calls"

    second = client.chat.completions.create(
        model=SIM_MODEL, messages=tool_result_turn(ASK_WEATHER, calls), tools=TOOLS, seed=11
    )
    choice = second.choices[0]
    assert not choice.message.tool_calls
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_the_calls_of_an_earlier_turn_reach_the_prompt(client: openai.OpenAI) -> None:
    """The assistant's ``tool_calls`` are part of the conversation: a prompt that keeps
    them is longer than the same prompt with them dropped (the bug of issue 29)."""
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    with_calls = tool_result_turn(ASK_WEATHER, [call])
    without_calls = [*ASK_WEATHER, {"role": "assistant", "content": ""}, with_calls[-1]]
    lengths = []
    for messages in (with_calls, without_calls):
        reply = client.chat.completions.create(
            model=SIM_MODEL, messages=messages, tools=TOOLS, max_tokens=4
        )
        assert reply.usage is not None
        lengths.append(reply.usage.prompt_tokens)
    # At least the name and the arguments of the call are in the prompt.
    assert lengths[0] >= lengths[1] + len("get_weather") + len(call["arguments"])


def test_streamed_calls_are_the_non_streamed_ones_in_fragments(client: openai.OpenAI) -> None:
    ask = {
        "model": SIM_MODEL,
        "messages": ASK_WEATHER,
        "tools": TOOLS,
        "tool_choice": "required",
        "seed": 7,
    }
    whole = calls_of(client.chat.completions.create(**ask))
    deltas = []
    finishes = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            assert choice.index == 0
            deltas += choice.delta.tool_calls or []
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    streamed = [assemble_streamed_calls(deltas)[i] for i in range(len(whole))]
    for call in streamed:
        check_call(call["name"], call["arguments"])
    # Same seed, same calls (ids are the server's to choose).
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c["name"], json.loads(c["arguments"])) for c in whole
    ]


def test_the_same_seed_calls_the_same_tools(client: openai.OpenAI) -> None:
    def ask() -> list[tuple[str, str]]:
        reply = client.chat.completions.create(
            model=SIM_MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", seed=5
        )
        return [(call["name"], call["arguments"]) for call in calls_of(reply)]

    assert ask() == ask()


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    for seed in range(4):
        reply = client.chat.completions.create(
            model=SIM_MODEL,
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
        )
        assert len(calls_of(reply)) == 1


def test_parse_gives_the_pydantic_tools_arguments(client: openai.OpenAI) -> None:
    # pydantic_function_tool sends a strict schema; parse() validates the arguments with
    # the model and raises on anything that does not fit.
    reply = client.chat.completions.parse(
        model=SIM_MODEL,
        messages=ASK_WEATHER,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
    )
    calls = reply.choices[0].message.tool_calls or []
    assert calls
    for call in calls:
        assert call.function.name == "Weather"
        assert isinstance(call.function.parsed_arguments, Weather)


def test_the_stream_helper_assembles_and_parses_tool_calls(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=SIM_MODEL,
        messages=ASK_WEATHER,
        tools=[openai.pydantic_function_tool(Weather, name="get_weather")],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert done and all(isinstance(event.parsed_arguments, Weather) for event in done)
    calls = final.choices[0].message.tool_calls or []
    assert [call.function.arguments for call in calls] == [event.arguments for event in done]
    for call in calls:
        assert isinstance(call.function.parsed_arguments, Weather)
        check_call("get_weather", call.function.arguments)


async def test_an_async_client_streams_a_second_turn_in_text(served: ServerProcess) -> None:
    async with openai.AsyncOpenAI(base_url=served.v1, api_key="unused") as client:
        first = await client.chat.completions.create(
            model=SIM_MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required"
        )
        stream = await client.chat.completions.create(
            model=SIM_MODEL,
            messages=tool_result_turn(ASK_WEATHER, calls_of(first)),
            tools=TOOLS,
            stream=True,
            max_tokens=24,
        )
        text, finishes = "", []
        async for chunk in stream:
            for choice in chunk.choices:
                assert not choice.delta.tool_calls
                text += choice.delta.content or ""
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
    assert text
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")


def test_a_tool_choice_naming_a_tool_not_offered_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=SIM_MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
    assert "get_time" in str(info.value)
