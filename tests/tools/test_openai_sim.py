"""Tool calling through the app on the sim engine, with the official openai client: the
sim writes calls valid for the tools' schemas, and they come back in OpenAI's shapes,
streamed and whole."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from sluicegate.tools.prompt import render_messages
from sluicegate.tools.sim_answer import AFTER_TOOL_RESULT
from sluicegate.tools.spec import tool_plan
from tests.support.inprocess import InProcessApp, serve_in_process
from tests.tools.support import ADD, TOOLS, WEATHER

MODEL = "sluicegate-sim"
ASK = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture
async def app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(max_num_seqs=16, max_model_len=4096) as served:
        yield served


def assert_valid(calls: list[Any]) -> None:
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def streamed(
    client: openai.AsyncOpenAI, **request: Any
) -> tuple[str, list[dict[str, Any]], str | None, list[Any]]:
    """Content, calls assembled from the deltas, finish reason, and the raw deltas."""
    stream = await client.chat.completions.create(model=MODEL, stream=True, **request)
    content, calls, finish, deltas = "", [], None, []
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                if delta.id is not None:
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return content, calls, finish, deltas


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_required_streamed_and_not(app: InProcessApp, seed: int) -> None:
    client = app.openai(max_retries=0)
    request: dict[str, Any] = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "seed": seed,
    }
    reply = await client.chat.completions.create(model=MODEL, **request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 2  # two tools, parallel calls allowed: the sim calls both
    assert {c.function.name for c in calls} == {"get_weather", "add"}
    assert_valid(calls)
    again = await client.chat.completions.create(model=MODEL, **request)
    assert again.choices[0].message.tool_calls == calls  # ids too: a function of the seed
    content, assembled, finish, deltas = await streamed(client, **request)
    assert (content, finish) == ("", "tool_calls")
    assert assembled == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in calls
    ]
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == [0, 1]
    assert all(d.type == "function" and d.function.name for d in firsts)


async def test_named_and_not_parallel(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            seed=4,
        )
        calls = reply.choices[0].message.tool_calls or []
        assert len(calls) == 1
        assert_valid(calls)
        if choice != "required":
            assert calls[0].function.name == "add"


async def test_auto_calls_then_answers_the_results(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=9)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert len(message.tool_calls or []) == 1
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": c.id, "content": "21 degrees"}
            for c in message.tool_calls or []
        ),
    ]
    second = await client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        seed=9,
        max_tokens=30,
    )
    assert second.choices[0].message.tool_calls is None
    # The sim's one sentence after a tool result, then the end (an agent loop ends).
    assert second.choices[0].message.content == AFTER_TOOL_RESULT
    assert second.choices[0].finish_reason == "stop"
    # The history reached the prompt: the calls and the result, in the generic format.
    plan = tool_plan(TOOLS, None, None)
    rendered, _ = render_messages(history, plan, native=False)
    expected = app.service.tokenizer.encode_chat(rendered)
    assert second.usage is not None
    assert second.usage.prompt_tokens == len(expected)
    prompt_text = app.service.tokenizer.decode(expected)
    assert message.tool_calls is not None
    assert f'id="{message.tool_calls[0].id}">\n21 degrees' in prompt_text
    assert message.tool_calls[0].function.arguments in prompt_text


async def test_none_answers_text(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", seed=1, max_tokens=20
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content
    content, calls, finish, _ = await streamed(
        client, messages=ASK, tools=TOOLS, tool_choice="none", seed=1, max_tokens=20
    )
    assert (content, calls, finish) == (reply.choices[0].message.content, [], "length")


async def test_legacy_functions(app: InProcessApp) -> None:
    response = await app.client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ASK,
            "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"},
            "seed": 3,
        },
    )
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


class Sum(BaseModel):
    a: int
    b: float


async def test_parse_with_a_pydantic_function_tool(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    tool = openai.pydantic_function_tool(Sum, name="add")
    reply = await client.beta.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add"}},
        seed=2,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1
    parsed = calls[0].function.parsed_arguments
    assert isinstance(parsed, Sum)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD, ADD]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": 1}]}]},
            "messages[0].tool_calls[0]",
        ),
    ],
)
async def test_bad_requests_are_specific_400s(
    app: InProcessApp, body: dict[str, Any], param: str
) -> None:
    response = await app.client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_call_cut_by_max_tokens_ends_with_length(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    request: dict[str, Any] = {
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "seed": 0,
        "max_tokens": 50,
    }
    reply = await client.chat.completions.create(model=MODEL, **request)
    assert reply.choices[0].finish_reason == "length"
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1  # what streamed of the first call: its name, part of its arguments
    content, assembled, finish, _ = await streamed(client, **request)
    assert (content, finish) == ("", "length")
    assert assembled == [
        {
            "id": calls[0].id,
            "name": calls[0].function.name,
            "arguments": calls[0].function.arguments,
        }
    ]
