"""The gateway measures an upstream's time to first token against the prompts prefilled
with each answer (the upstream's own and those sent to it meanwhile), as admission
predicts it (``admission/work.py``), and leaves no prompt counted once answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from sluicegate.config import Settings
from sluicegate.engine.output import RequestStream
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.signals import Latency
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.scheduler.request import Request, SamplingParams
from tests.upstream.in_memory import answer_in_memory

MODEL = "group-model"


class SpyLatency(Latency):
    """The upstream's latency, keeping the prompt tokens each TTFT was measured against."""

    def __init__(self) -> None:
        super().__init__()
        self.measured: list[int] = []

    def observe(self, prompt_tokens: int, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self.measured.append(prompt_tokens)
        super().observe(prompt_tokens, ttft, tpot)


async def _two_answers(prefill: str) -> tuple[list[int], int]:
    """Two requests (prompts of 10 and 4 tokens) sent to one upstream, which sends no
    first token until it holds both; the prompt tokens each TTFT was measured against."""
    settings = Settings(
        engine="upstream", upstream=["http://upstream.test"], upstream_prefill=prefill
    )
    pool = UpstreamPool(settings)
    core = UpstreamCore(pool, byte_level_tokenizer(), settings, max_model_len=1 << 20)
    both = asyncio.Event()
    arrived = 0

    async def body() -> AsyncIterator[bytes]:
        await both.wait()
        yield b'data: {"choices":[{"index":0,"text":"a ","finish_reason":null}]}\n\n'
        yield b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
        yield b"data: [DONE]\n\n"

    def answer(request: httpx.Request) -> AsyncIterator[bytes]:
        nonlocal arrived
        arrived += 1
        if arrived == 2:
            both.set()
        return body()

    upstream = pool.upstreams[0]
    await answer_in_memory(upstream, answer, MODEL)
    spy = upstream.latency = SpyLatency()
    streams = []
    for rid, prompt in (("r1", "0123456789"), ("r2", "abcd")):
        call = UpstreamCall("completion", {"model": MODEL, "prompt": prompt}, MODEL, 2)
        request = Request(rid, list(prompt.encode()), SamplingParams(seed=1, max_tokens=2))
        stream = RequestStream(rid)
        core.add_request(request, stream, call)
        streams.append(stream)
    async with asyncio.timeout(30):
        for stream in streams:
            while (await stream.get()).finish_reason is None:
                pass
    await core.close()
    return sorted(spy.measured), upstream.prefill.tokens


def test_each_first_token_counts_the_prompts_prefilled_with_it() -> None:
    # Together (the default): each answer's TTFT is measured against both prompts.
    assert asyncio.run(_two_answers("together")) == ([14, 14], 0)
    # First-come first-served: the first sent counts its own, the second both.
    assert asyncio.run(_two_answers("in_order")) == ([10, 14], 0)
