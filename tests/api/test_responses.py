"""The Responses API in process (the sim engine), with the official client unmodified:
create (streamed or not), retrieve, resume from a sequence number, continue a
conversation, function tools, background and cancel, delete, input items, and the 4xx of
bad requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests.support.inprocess import InProcessApp, serve_in_process

TENANTS = [{"name": "alpha", "api_key": "key-alpha"}, {"name": "beta", "api_key": "key-beta"}]
SEEDED = {"seed": 11}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture
async def app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(admission="static", tenants=TENANTS) as served:
        yield served


def client(app: InProcessApp, key: str = "key-alpha") -> openai.AsyncOpenAI:
    return app.openai(api_key=key, max_retries=0)


async def test_a_response_is_created_retrieved_and_listed(app: InProcessApp) -> None:
    alpha = client(app)
    made = await alpha.responses.create(
        input="Say hello", instructions="Be brief.", max_output_tokens=16, extra_body=SEEDED
    )
    assert made.object == "response"
    assert made.status in ("completed", "incomplete")
    assert made.output_text
    assert made.instructions == "Be brief."
    assert made.usage is not None
    assert made.usage.output_tokens <= 16
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    again = await alpha.responses.retrieve(made.id)
    assert again.model_dump() == made.model_dump()
    items = await alpha.responses.input_items.list(made.id)
    assert [item.type for item in items.data] == ["message"]
    # Another tenant's response does not exist for beta.
    with pytest.raises(openai.NotFoundError):
        await client(app, "key-beta").responses.retrieve(made.id)


async def test_streamed_events_are_numbered_and_end_with_the_whole_response(
    app: InProcessApp,
) -> None:
    alpha = client(app)
    events = [
        e
        async for e in await alpha.responses.create(
            input="Tell me a story", max_output_tokens=24, stream=True, extra_body=SEEDED
        )
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete"
        if events[-1].response.status == "incomplete"
        else "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text
    assert events[-4].text == text
    # The same seeded request, not streamed, gives the same text.
    whole = await alpha.responses.create(
        input="Tell me a story", max_output_tokens=24, extra_body=SEEDED
    )
    assert whole.output_text == text
    # And the stored one is what the stream ended with.
    assert (await alpha.responses.retrieve(final.id)).output_text == text


@pytest.mark.parametrize("starting_after", [-1, 0, 3, 5, 9])
async def test_a_stream_resumes_after_any_sequence_number(
    app: InProcessApp, starting_after: int
) -> None:
    alpha = client(app)
    stream = await alpha.responses.create(
        input="Count", max_output_tokens=12, stream=True, extra_body=SEEDED
    )
    events = [e async for e in stream]
    response_id = events[0].response.id
    rest = await alpha.responses.retrieve(response_id, stream=True, starting_after=starting_after)
    resumed = [e async for e in rest]
    assert [e.model_dump() for e in resumed] == [
        e.model_dump() for e in events[starting_after + 1 :]
    ]
    with pytest.raises(openai.BadRequestError) as past:
        await alpha.responses.retrieve(response_id, stream=True, starting_after=len(events) + 5)
    assert past.value.code == "invalid_position"


async def test_a_conversation_continues_from_the_previous_response(app: InProcessApp) -> None:
    alpha = client(app)
    first = await alpha.responses.create(input="My name is Ada.", max_output_tokens=8)
    second = await alpha.responses.create(
        input="What is my name?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    # The first turn and its answer were not computed again.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # Its input items are its own (the previous turns belong to the previous response).
    items = await alpha.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    assert items.data[0].content[0].text == "What is my name?"
    # Another tenant cannot continue it.
    with pytest.raises(openai.NotFoundError) as refused:
        await client(app, "key-beta").responses.create(input="Hi", previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_function_tools_call_and_take_their_output(app: InProcessApp) -> None:
    alpha = client(app)
    called = await alpha.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=200,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls, called.output
    assert calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    answered = await alpha.responses.create(
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny."}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=12,
    )
    assert answered.status in ("completed", "incomplete")
    # Streamed, the arguments come as deltas that add up to the call.
    events = [
        e
        async for e in await alpha.responses.create(
            input="Weather in Rome?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=200,
            stream=True,
        )
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == deltas
    assert json.loads(deltas)["city"]


async def test_background_responses_run_unread_and_can_be_cancelled(app: InProcessApp) -> None:
    alpha = client(app)
    short = await alpha.responses.create(input="Hi", background=True, max_output_tokens=8)
    assert short.status == "queued" and short.background
    polled = await alpha.responses.retrieve(short.id)
    async with asyncio.timeout(30):
        while polled.status in ("queued", "in_progress"):
            await asyncio.sleep(0.01)
            polled = await alpha.responses.retrieve(short.id)
    assert polled.status in ("completed", "incomplete"), polled.status
    assert polled.output_text

    long = await alpha.responses.create(
        input="A long story",
        background=True,
        max_output_tokens=2000,
        extra_body={"max_tokens_per_second": 20},
    )
    cancelled = await alpha.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert (await alpha.responses.retrieve(long.id)).status == "cancelled"
    # Cancelling again says the same; a finished one cannot be.
    assert (await alpha.responses.cancel(long.id)).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        await alpha.responses.cancel(short.id)


async def test_deleted_and_unstored_responses_are_not_found(app: InProcessApp) -> None:
    alpha = client(app)
    made = await alpha.responses.create(input="Hi", max_output_tokens=4)
    deleted = await alpha.with_raw_response.responses.delete(made.id)  # type: ignore[attr-defined]
    assert deleted.status_code == 200
    assert json.loads(deleted.text) == {"id": made.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await alpha.responses.retrieve(made.id)
    unstored = await alpha.responses.create(input="Hi", max_output_tokens=4, store=False)
    assert unstored.output_text
    with pytest.raises(openai.NotFoundError):
        await alpha.responses.retrieve(unstored.id)


async def test_truncation_auto_drops_the_oldest_items_and_says_so() -> None:
    async with serve_in_process(admission="static", tenants=TENANTS, max_model_len=256) as served:
        alpha = client(served)
        history: list[Any] = [
            {"role": "user", "content": f"Message number {i} " + "word " * 30} for i in range(8)
        ]
        history.append({"role": "user", "content": "And now?"})
        with pytest.raises(openai.BadRequestError) as too_long:
            await alpha.responses.create(input=history, max_output_tokens=16)
        assert too_long.value.code == "context_length_exceeded"
        assert too_long.value.body["param"] == "input"  # type: ignore[index]
        fitted = await alpha.responses.create(
            input=history, max_output_tokens=16, truncation="auto"
        )
        assert fitted.truncation == "auto"
        dropped = fitted.model_extra["sluicegate"]["truncated_input_items"]  # type: ignore[index]
        assert 1 <= dropped < len(history)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": "x", "previous_response_id": "resp-unknown"}, "previous_response_id"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ],
)
async def test_bad_requests_are_400s_naming_the_parameter(
    app: InProcessApp, body: dict[str, Any], param: str
) -> None:
    reply = await app.client.post(
        "/v1/responses", json=body, headers={"authorization": "Bearer key-alpha"}
    )
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    # Nothing leaked: no request is left running.
    assert app.service.generations == {} or all(g.ended for g in app.service.generations.values())
