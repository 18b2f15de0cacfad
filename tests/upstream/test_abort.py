"""An abort always ends the relay, even when it arrives in the same loop iteration as the
upstream's next line (a race that ``asyncio.wait_for`` on Python 3.11 loses: it returned
the line and dropped the cancellation, so the gateway relayed the whole answer of a
client that had gone; seen once in CI as an upstream that never saw the abort)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sluicegate.config import Settings
from sluicegate.engine.output import RequestStream
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from tests.upstream.in_memory import answer_in_memory

MODEL = "relay-model"
LINES = 400


def _event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"w%d ","finish_reason":null}]}\n\n' % i


async def _relay(abort_at: int | None) -> tuple[FinishReason | None, int]:
    """Relay a ``LINES``-line answer; the upstream's body calls the abort itself just
    before it yields line ``abort_at``.  Returns (finish, lines the upstream sent)."""
    settings = Settings(engine="upstream", upstream=["http://upstream.test"])
    pool = UpstreamPool(settings)
    core = UpstreamCore(pool, byte_level_tokenizer(), settings, max_model_len=1 << 20)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for i in range(LINES):
            if i == abort_at:
                core.abort_request("r1")
            sent += 1
            yield _event(i)
            await asyncio.sleep(0)
        yield b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
        yield b"data: [DONE]\n\n"

    upstream = pool.upstreams[0]
    await answer_in_memory(upstream, lambda request: body(), MODEL)
    call = UpstreamCall("completion", {"model": MODEL, "prompt": "Once"}, MODEL, LINES + 10)
    request = Request("r1", [79, 110, 99, 101], SamplingParams(seed=1, max_tokens=LINES + 10))
    stream = RequestStream("r1")
    core.add_request(request, stream, call)
    finish: FinishReason | None = None
    async with asyncio.timeout(30):
        while finish is None:
            output = await stream.get()
            finish = output.finish_reason
    await core.close()
    return finish, sent


def test_a_relay_runs_to_its_end_without_an_abort() -> None:
    finish, sent = asyncio.run(_relay(None))
    assert finish is FinishReason.LENGTH and sent == LINES


def test_an_abort_meeting_a_line_ends_the_relay_at_once() -> None:
    finish, sent = asyncio.run(_relay(abort_at=5))
    assert finish is FinishReason.ABORT
    assert sent <= 7, f"the relay went on reading {sent} of {LINES} lines after the abort"
