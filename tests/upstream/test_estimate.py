"""The start-up probe of each upstream's time to first token (``estimate.calibrate``) reads
its lines as the relay does: an upstream answering the probe with one endless line costs
the gateway ``upstream_max_event_bytes`` of reading, not the line (httpx's own line reader
would hold all of it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sluicegate.config import Settings
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.engine.upstream.estimate import calibrate
from sluicegate.engine.upstream.pool import UpstreamPool
from tests.upstream.in_memory import answer_in_memory

MODEL = "probe-model"
CHUNK = 64 << 10
MAX_EVENT = 256 << 10
#: The hostile line: 32 MB, never ended.
LINE_CHUNKS = 512


async def _probe(answer: bytes | None = None) -> tuple[int, bool]:
    """Calibrate a pool of one upstream whose every answer is one unending line (or
    ``answer``); returns (bytes the gateway pulled from it, whether a TTFT was measured)."""
    settings = Settings(engine="upstream", upstream=["http://upstream.test"])
    pool = UpstreamPool(settings)
    pulled = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(LINE_CHUNKS):
            pulled += CHUNK
            yield b"data: " + b"x" * (CHUNK - 6)
            await asyncio.sleep(0)

    upstream = pool.upstreams[0]
    await answer_in_memory(
        upstream, lambda request: answer if answer is not None else endless(), MODEL
    )
    await calibrate(pool, byte_level_tokenizer(), "a longer probe " * 20, 10.0, MAX_EVENT)
    await upstream.client.aclose()
    return pulled, upstream.latency.ttft_seconds is not None


def test_an_endless_line_is_read_up_to_the_event_limit() -> None:
    pulled, measured = asyncio.run(_probe())
    assert pulled <= MAX_EVENT + 2 * CHUNK, f"{pulled} bytes read of one line"
    assert not measured  # no first token: nothing measured


def test_a_well_formed_answer_is_measured() -> None:
    event = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
    _, measured = asyncio.run(_probe(event))
    assert measured
