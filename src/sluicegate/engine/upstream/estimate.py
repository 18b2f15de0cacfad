"""The pool as admission sees it, and its measurement at start.

Admission by objective predicts with a :class:`ServiceEstimate`: seats, the time per
output token and the time to first token of a prompt.  For the pool they are measured:
each upstream's TTFT fitted against prompt length and its TPOT (moving averages of its
answers), averaged over the healthy upstreams; the seats are the sum of their limits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.wire import EventTooLarge, bounded_lines
from sluicegate.scheduler.seat_limit import ServiceEstimate

#: Before any answer is measured: a typical GPU engine's TTFT and TPOT.
_PRIOR_TTFT_SECONDS = 0.3
_PRIOR_TPOT_SECONDS = 0.03


@dataclass(slots=True, frozen=True)
class UpstreamEstimate(ServiceEstimate):
    """The pool as admission sees it: places, and the measured TTFT (by prompt length)
    and TPOT of its upstreams' answers."""

    ttft_base_seconds: float = _PRIOR_TTFT_SECONDS
    ttft_per_token_seconds: float = 0.0

    def prefill_seconds(self, num_prompt_tokens: int, num_decoding: int | None = None) -> float:
        return self.ttft_base_seconds + self.ttft_per_token_seconds * num_prompt_tokens


def pool_estimate(
    pool: UpstreamPool,
    seat_limit: int,
    mean_prompt: float,
    mean_output: float,
    *,
    shared_prefill: bool = True,
) -> ServiceEstimate:
    """The pool's places and measured latencies (priors before any answer);
    ``shared_prefill``: its engines prefill the prompts they hold together."""
    healthy = [u for u in pool.upstreams if u.healthy] or pool.upstreams
    known = [f for u in healthy if (f := u.latency.fit()) is not None]
    base, slope = (
        (sum(f[0] for f in known) / len(known), sum(f[1] for f in known) / len(known))
        if known
        else (_PRIOR_TTFT_SECONDS, 0.0)
    )
    tpots = [u.latency.tpot_seconds for u in healthy if u.latency.tpot_seconds is not None]
    return UpstreamEstimate(
        seat_limit=max(1, seat_limit),
        step_seconds=sum(tpots) / len(tpots) if tpots else _PRIOR_TPOT_SECONDS,
        mean_prompt_tokens=mean_prompt,
        mean_output_tokens=mean_output,
        max_num_batched_tokens=1 << 30,
        cost=(0.0,) * 6,
        ttft_base_seconds=base,
        ttft_per_token_seconds=slope,
        shared_prefill=shared_prefill,
    )


async def calibrate(
    pool: UpstreamPool,
    tokenizer: TextTokenizer,
    probe_text: str,
    timeout_seconds: float,
    max_event_bytes: int,
) -> None:
    """Measure each healthy upstream's TTFT with a short and a long prompt (one-token
    answers), so that admission predicts from the first request on.  Its lines are read
    as the relay reads them, none over ``max_event_bytes`` (a hostile upstream's huge
    first event ends the probe, not the gateway's memory)."""
    for upstream in [u for u in pool.upstreams if u.healthy]:
        models = upstream.served_models()
        if not models:
            continue
        for prompt in ("Hi", probe_text):
            body = {
                "model": upstream.upstream_model(models[0]),
                "prompt": prompt,
                "max_tokens": 1,
                "stream": True,
            }
            started = time.monotonic()
            try:
                async with upstream.client.stream(
                    "POST", "/v1/completions", json=body, timeout=timeout_seconds
                ) as response:
                    if response.status_code != 200:
                        break
                    lines = bounded_lines(response.aiter_bytes(), max_event_bytes)
                    async for line in lines:
                        if line.startswith("data:"):
                            break
            except (httpx.HTTPError, EventTooLarge):
                break
            ttft = time.monotonic() - started
            upstream.latency.observe(len(tokenizer.encode(prompt)), ttft, None)
