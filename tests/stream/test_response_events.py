"""A response's events from chat chunks: numbered from 0, items opened and closed in
order, and a state that the log alone rebuilds (what a takeover and ``GET`` rely on)."""

from __future__ import annotations

from typing import Any

import pytest

from sluicegate.stream.response_events import (
    ResponseEvents,
    decode_events,
    drop_through,
    last_sequence_number,
)
from sluicegate.stream.sse import with_event_id

TEMPLATE = {"id": "resp-test", "object": "response", "model": "m", "background": False}


def text(piece: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}


def call(index: int, name: str | None, arguments: str) -> dict[str, Any]:
    fragment: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        fragment["id"] = f"call_{index}"
        fragment["type"] = "function"
        fragment["function"]["name"] = name
    return {"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}}]}


CHUNKS = [
    text("Let me "),
    text("check."),
    call(0, "get_weather", '{"city": '),
    call(0, None, '"Paris"}'),
    call(1, "get_time", "{}"),
]
ENDING = [
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}},
]


def entries() -> list[bytes]:
    events = ResponseEvents(TEMPLATE)
    logged = [events.opening()]
    logged += [events.encode(chunk) for chunk in CHUNKS]
    logged.append(events.finish(ENDING))
    return logged


def test_events_are_numbered_and_the_response_is_whole() -> None:
    logged = entries()
    decoded = [event for data in logged for event in decode_events(data)]
    assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
    final = decoded[-1]
    assert final["type"] == "response.completed"
    output = final["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me check."
    assert output[1]["arguments"] == '{"city": "Paris"}'
    assert output[1]["call_id"] == "call_0"
    assert output[2]["name"] == "get_time"
    assert all(item["status"] == "completed" for item in output)
    assert final["response"]["usage"]["total_tokens"] == 12
    # Every item is added once and done once, and closed before the next opens.
    added = [e["output_index"] for e in decoded if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in decoded if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]


@pytest.mark.parametrize("cut", range(1, 7))
def test_a_log_cut_anywhere_continues_byte_for_byte(cut: int) -> None:
    logged = entries()
    restored = ResponseEvents.restore(TEMPLATE, logged[:cut])
    rest = [restored.encode(chunk) for chunk in CHUNKS[cut - 1 :]]
    rest.append(restored.finish(ENDING))
    assert rest == logged[cut:]


def test_the_length_limit_and_failures_end_as_the_api_says() -> None:
    limited = ResponseEvents(TEMPLATE)
    limited.opening()
    limited.encode(text("abc"))
    end = limited.finish([{"choices": [{"finish_reason": "length"}]}])
    assert b"response.incomplete" in end
    assert limited.response()["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = ResponseEvents(TEMPLATE)
    failed.opening()
    failed.fail({"code": "engine_error", "message": "boom"})
    assert failed.response()["status"] == "failed"
    assert failed.response()["error"] == {"code": "engine_error", "message": "boom"}
    queued = ResponseEvents({**TEMPLATE, "background": True})
    assert [e["type"] for e in decode_events(queued.opening())] == ["response.created"]
    assert queued.status == "queued"
    assert b"response.in_progress" in queued.encode(text("x"))


def test_dropping_through_a_sequence_number_keeps_the_entry_id() -> None:
    logged = entries()
    entry = with_event_id(logged[-1], "resp-test:7")
    first = min(e["sequence_number"] for e in decode_events(entry))
    last = last_sequence_number(entry)
    assert last is not None
    kept = drop_through(entry, first + 1)
    assert [e["sequence_number"] for e in decode_events(kept)] == list(range(first + 2, last + 1))
    assert kept.count(b"id: resp-test:7") == 1
    assert drop_through(entry, last) == b""
