"""The Responses API in front of an upstream that serves chat completions: a response is
relayed as the chat completion it translates to (instructions as the system message,
``max_output_tokens`` as ``max_completion_tokens``, flat function tools in the chat
shape), and the upstream's text and tool-call deltas come back as the Responses API's
events.  The gateway runs in process; the upstream is a scripted one on a real socket."""

from __future__ import annotations

import json
from typing import Any

from tests.upstream.scripted import MODEL, call_args, call_start, finish, text
from tests.upstream.test_passthrough import TWO_CALLS, always, gateway

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def test_a_response_is_relayed_as_a_chat_completion() -> None:
    script = always(text("Hello "), text("there."), finish("stop"))
    async with gateway(script) as (app, upstream):
        client = app.openai(max_retries=0)
        made = await client.responses.create(
            model=MODEL,
            input="Hi",
            instructions="Be kind.",
            max_output_tokens=20,
            extra_body={"vendor_option": 7},
        )
        sent = upstream.calls[0]
    assert made.output_text == "Hello there."
    assert made.status == "completed"
    assert sent["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
    ]
    assert sent["max_tokens"] == 20  # what admission counted
    assert sent["vendor_option"] == 7  # unknown fields reach the upstream as sent
    assert not {"input", "instructions", "max_output_tokens", "store"} & set(sent)


async def test_upstream_tool_calls_stream_as_function_call_events() -> None:
    async with gateway(always(*TWO_CALLS)) as (app, upstream):
        client = app.openai(max_retries=0)
        stream = await client.responses.create(
            model=MODEL,
            input="Weather in Paris and Rome?",
            tools=[WEATHER],  # type: ignore[list-item]
            stream=True,
        )
        events: list[Any] = [event async for event in stream]
        sent = upstream.calls[0]
    assert sent["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    kinds = [item.type for item in final.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Let me check."
    calls = [(item.call_id, item.name, json.loads(item.arguments)) for item in final.output[1:]]
    assert calls == [
        ("call_a", "get_weather", {"city": "Paris"}),
        ("call_b", "get_weather", {"city": "Rome"}),
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_function_call_output_goes_back_as_a_tool_message() -> None:
    script = always(call_start(0, "call_x", "get_weather"), call_args(0, "{}"), finish("stop"))
    async with gateway(script) as (app, upstream):
        client = app.openai(max_retries=0)
        await client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "Weather?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "Snow."},
            ],
            tools=[WEATHER],  # type: ignore[list-item]
        )
        sent = upstream.calls[0]
    assert sent["messages"][1]["tool_calls"][0]["id"] == "call_1"
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}
