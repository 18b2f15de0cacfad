"""An upstream that falls silent mid-answer, however it does it: quietly, or sending only
SSE comments (another Sluicegate's queue position and heartbeats), and as often as it is
asked again.  The client's stream always ends: with the answer, asked again from the
start and skipped where it has parts already (restart-and-skip), or with an error once
the upstreams have failed it too often.  Never a stream that hangs on keep-alives.

The upstreams are scripted (tests/upstream/scripted.py); the bound on each request's
wall time (``HANG_SECONDS``) is many times the gateway's timeouts, so only a stream that
hangs misses it."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

import orjson

from sluicegate.engine.upstream.wire import parse_event
from tests.support.inprocess import InProcessApp, serve_in_process
from tests.upstream.scripted import Answer, ScriptedUpstream, text
from tests.upstream.test_passthrough import TWO_CALLS, WHOLE_CALLS, ended, sse_chunks
from tests.upstream.test_restart import BODY, parts

#: The gateway's timeouts: a silence of more than a second is a failure.
TIMEOUTS = (
    "--upstream-first-token-timeout-seconds",
    "1",
    "--upstream-idle-timeout-seconds",
    "1",
    # Health checks bring an ejected upstream back quickly (and reset its failures), so
    # nothing but the relay's own bound ends a request it keeps failing.
    "--upstream-health-interval-seconds",
    "0.3",
)
#: Longer than any silence the gateway waits out (an upstream silent "forever").
FOREVER = 3600.0
#: A request that has not ended by now hangs (its silences add up to a few seconds).
HANG_SECONDS = 60.0
#: After the text and the first call, before the second call.
BEFORE_SECOND_CALL = 4


async def streamed(app: InProcessApp, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    async with asyncio.timeout(HANG_SECONDS):
        response = await app.client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert ended(response.text), response.text[-500:]
    return response.text, sse_chunks(response.text)


async def test_comments_do_not_keep_a_silent_upstream_alive() -> None:
    """Mid-answer it sends only comments, once a tenth of a second: silent all the same.
    The answer is asked again and the client gets each call once."""

    def script(body: dict[str, Any], attempt: int) -> Answer:
        if attempt == 0:
            silent = {BEFORE_SECOND_CALL: FOREVER}
            return Answer(TWO_CALLS, silent_before=silent, comment_every_seconds=0.1)
        return Answer(TWO_CALLS)

    upstream = ScriptedUpstream(script).start()
    try:
        async with gateway([upstream]) as app:
            _, chunks = await streamed(app, BODY)
        content, calls, finishes = parts(chunks)
        assert content == "Let me check." and calls == WHOLE_CALLS
        assert finishes == ["tool_calls"]
        assert len(upstream.calls) == 2
    finally:
        upstream.stop()


async def test_comments_do_not_stand_for_a_first_token() -> None:
    """Queued inside an upstream for good (its position sent every tenth of a second):
    the first-token timeout moves the request to the other upstream."""
    calls: list[int] = []

    def script(body: dict[str, Any], attempt: int) -> Answer:
        calls.append(attempt)
        if len(calls) == 1:  # the first call of either upstream
            return Answer(TWO_CALLS, silent_before={0: FOREVER}, comment_every_seconds=0.1)
        return Answer(TWO_CALLS)

    first, second = ScriptedUpstream(script).start(), ScriptedUpstream(script).start()
    try:
        async with gateway([first, second]) as app:
            _, chunks = await streamed(app, BODY)
        assert parts(chunks) == ("Let me check.", WHOLE_CALLS, ["tool_calls"])
        assert len(calls) == 2
    finally:
        first.stop()
        second.stop()


async def test_a_reasoning_model_thinking_is_not_silent() -> None:
    """Reasoning tokens (which the gateway does not relay), a few tenths of a second apart
    for longer than both timeouts (1.5 s): the upstream is working, and is waited for."""
    thinking = [{"index": 0, "delta": {"reasoning_content": "hmm "}} for _ in range(4)]
    events = [*thinking, text("Paris.", 0, "stop")]
    pauses = dict.fromkeys(range(len(events)), 0.3)
    upstream = ScriptedUpstream(lambda body, attempt: Answer(events, silent_before=pauses)).start()
    try:
        async with gateway([upstream]) as app:
            _, chunks = await streamed(app, BODY)
        assert parts(chunks) == ("Paris.", [], ["stop"])
        assert len(upstream.calls) == 1
    finally:
        upstream.stop()


def test_only_deltas_with_something_in_them_are_progress() -> None:
    def progress(choice: dict[str, Any]) -> bool:
        delta = parse_event(orjson.dumps({"choices": [choice]}))
        assert delta is not None
        return delta.choices[0].progress

    assert not progress({"index": 0, "delta": {"role": "assistant", "content": ""}})
    assert not progress({"index": 0, "delta": {"content": None, "tool_calls": []}})
    assert progress({"index": 0, "delta": {"reasoning_content": "so"}})
    assert progress({"index": 0, "delta": {}, "finish_reason": "stop"})
    assert progress({"index": 0, "text": "x"})  # a completion's


async def test_an_upstream_silent_on_every_restart_ends_the_stream_with_an_error() -> None:
    """It dies after the first call; asked again, it repeats that call and falls silent,
    every time.  The gateway gives up after a few calls, and says so."""

    def script(body: dict[str, Any], attempt: int) -> Answer:
        if attempt == 0:
            return Answer(TWO_CALLS, dies_after=BEFORE_SECOND_CALL)
        return Answer(TWO_CALLS, silent_before={BEFORE_SECOND_CALL: FOREVER})

    upstream = ScriptedUpstream(script).start()
    try:
        async with gateway([upstream]) as app:
            raw, chunks = await streamed(app, BODY)
            stats = (await app.client.get("/v1/stats")).json()
        content, calls, _ = parts(chunks)
        assert content == "Let me check." and calls == WHOLE_CALLS[:1]
        assert raw.count('"call_') == 1
        error = next(c["error"] for c in chunks if "error" in c)
        assert error["code"] == "upstream_failed", error
        assert "silent for 1 s" in error["message"], error
        assert 2 <= len(upstream.calls) <= 4
        (held,) = stats["upstreams"].values()
        assert held["outstanding_requests"] == 0
    finally:
        upstream.stop()


def gateway(upstreams: list[ScriptedUpstream]) -> AbstractAsyncContextManager[InProcessApp]:
    return serve_in_process(
        "--upstream-tokenizer",
        "bytes",
        "--admission",
        "static",
        *TIMEOUTS,
        engine="upstream",
        upstream=[u.url for u in upstreams],
    )
