"""An answer cut short on its upstream: text-only answers of one choice are continued (the
partial text appended); answers with tool calls or several choices are asked again from
the start, and what the client already has is skipped where the new answer repeats it
exactly (restart-and-skip), or the stream ends with a clear error where it does not.
Never a call twice, never half a call.  The upstream is scripted (tests/upstream/
scripted.py) and dies mid-answer as a crashed engine's stream does: no finish, no
``[DONE]``."""

from __future__ import annotations

from typing import Any

import orjson

from tests.support.inprocess import InProcessApp, serve_in_process
from tests.upstream.scripted import (
    MODEL,
    Answer,
    Script,
    ScriptedUpstream,
    call_args,
    call_start,
    finish,
    text,
)
from tests.upstream.test_passthrough import (
    MESSAGES,
    TOOLS,
    TWO_CALLS,
    WHOLE_CALLS,
    ended,
    gateway,
    sse_chunks,
)


def dies_first(events: list[Any], dies_after: int, again: list[Any] | None = None) -> Script:
    """The first call dies after ``dies_after`` events; later ones answer ``again`` (the
    same events by default) whole."""

    def script(body: dict[str, Any], attempt: int) -> Answer:
        if attempt == 0:
            return Answer(events, dies_after)
        return Answer(events if again is None else again)

    return script


async def streamed(app: InProcessApp, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    response = await app.client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert ended(response.text)
    return response.text, sse_chunks(response.text)


def parts(chunks: list[dict[str, Any]], index: int = 0) -> tuple[str, list[Any], list[str]]:
    """One choice's text, tool-call deltas and finish reasons, as its client got them."""
    content, calls, finishes = "", list[Any](), list[str]()
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            if choice["index"] != index:
                continue
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return content, calls, finishes


BODY: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200}


async def test_a_tool_call_answer_cut_mid_call_is_asked_again_and_skipped() -> None:
    # It dies inside the second call: the text and the first call were sent, the second
    # call's first half was held at the gateway.
    async with gateway(dies_first(TWO_CALLS, dies_after=6)) as (app, upstream):
        _, chunks = await streamed(app, BODY)
        content, calls, finishes = parts(chunks)
        assert content == "Let me check."
        assert calls == WHOLE_CALLS  # each once, whole
        assert finishes == ["tool_calls"]
        first, second = upstream.calls
    # Asked again from the start: the same body (the same seed), not a continuation.
    assert second == first and isinstance(first["seed"], int)
    assert "continue_final_message" not in second


async def test_a_restarted_answer_that_differs_ends_with_an_error() -> None:
    other = [
        text("Let me check."),
        call_start(0, "call_z", "get_weather"),
        call_args(0, '{"city": "Lyon"}'),
        finish("tool_calls"),
    ]
    async with gateway(dies_first(TWO_CALLS, dies_after=5, again=other)) as (app, upstream):
        raw, chunks = await streamed(app, BODY)
        content, calls, _ = parts(chunks)
        assert len(upstream.calls) == 2
    # What the client got before the failure, once; nothing of the different answer.
    assert content == "Let me check." and calls == WHOLE_CALLS[:1]
    error = next(c["error"] for c in chunks if "error" in c)
    assert error["code"] == "upstream_answer_diverged"
    assert "tool call 0 differs" in error["message"], error
    assert raw.count('"call_') == 1


async def test_several_choices_cut_short_are_asked_again_and_skipped() -> None:
    events = [
        text("Hel", 0),
        text("Bon", 1),
        text("lo", 0),
        text("jour", 1, "stop"),
        text(" there", 0, "length"),
    ]
    async with gateway(dies_first(events, dies_after=3)) as (app, upstream):
        body = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 9}
        _, chunks = await streamed(app, body)
        assert parts(chunks, 0) == ("Hello there", [], ["length"])
        assert parts(chunks, 1) == ("Bonjour", [], ["stop"])
        assert len(upstream.calls) == 2 and upstream.calls[1] == upstream.calls[0]


async def test_an_upstream_that_dies_between_choices_has_not_answered() -> None:
    """One choice finished and the stream ended without ``[DONE]``: the other choice was
    cut, so the answer is asked again (a finish of choice 0 alone is not the end)."""
    events = [text("Hi", 1), text("Hello", 0, "stop"), text(" you", 1, "stop")]
    async with gateway(dies_first(events, dies_after=2)) as (app, upstream):
        body = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 9}
        _, chunks = await streamed(app, body)
        assert parts(chunks, 0) == ("Hello", [], ["stop"])
        assert parts(chunks, 1) == ("Hi you", [], ["stop"])
        assert len(upstream.calls) == 2


async def test_a_text_answer_is_continued_as_before() -> None:
    events = [text("Once"), text(" upon"), text(" a time", 0, "stop")]

    def script(body: dict[str, Any], attempt: int) -> Answer:
        if attempt == 0:
            return Answer(events, dies_after=2)
        return Answer([text(" a time", 0, "stop")])

    async with gateway(script) as (app, upstream):
        body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
        _, chunks = await streamed(app, body)
        assert parts(chunks) == ("Once upon a time", [], ["stop"])
        continuation = upstream.calls[1]
    assert continuation["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert continuation["continue_final_message"] is True
    assert continuation["tools"] == TOOLS  # the rest of the body as sent


async def test_a_tool_call_stream_replays_identically() -> None:
    async with gateway(dies_first(TWO_CALLS, dies_after=6)) as (app, _):
        response = await app.client.post("/v1/chat/completions", json={**BODY, "stream": True})
        assert response.status_code == 200, response.text
        stream_id = response.headers["x-request-id"]
        token = response.headers["x-sluicegate-resume-token"]
        replay = await app.client.get(
            f"/v1/streams/{stream_id}",
            headers={"x-sluicegate-resume-token": token, "last-event-id": f"{stream_id}:1"},
        )
        assert replay.status_code == 200, replay.text
    sent = [line for line in response.text.splitlines() if line.startswith(("id:", "data:"))]
    again = [line for line in replay.text.splitlines() if line.startswith(("id:", "data:"))]
    # Everything after event 1 (the role), byte for byte (the tool calls whole, once).
    first = sent.index(f"id: {stream_id}:1")
    assert again == sent[first + 1 :]
    assert sum(line.count('"call_') for line in again) == 2
    calls = [
        call
        for line in again
        if line.startswith("data: {")
        for choice in orjson.loads(line[6:]).get("choices", [])
        for call in choice["delta"].get("tool_calls", [])
    ]
    assert calls == WHOLE_CALLS


async def test_a_tools_answer_is_not_continued_as_a_completion() -> None:
    """Continued as a completion of the rendered conversation (``continuation:
    completion``), a request would lose its tools: it is asked again instead."""
    events = [text("Once"), text(" upon"), text(" a time", 0, "stop")]
    upstream = ScriptedUpstream(dies_first(events, dies_after=2)).start()
    try:
        async with serve_in_process(
            "--upstream-tokenizer",
            "bytes",
            "--admission",
            "static",
            engine="upstream",
            upstreams=[{"url": upstream.url, "continuation": "completion"}],
        ) as app:
            body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
            _, chunks = await streamed(app, body)
            assert parts(chunks) == ("Once upon a time", [], ["stop"])
        first, second = upstream.calls
        assert second == first and upstream.paths[-1] == "/v1/chat/completions"
    finally:
        upstream.stop()
