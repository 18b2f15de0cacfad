"""``sluicegate bench long-prompts``: do running streams keep their pace while long
prompts arrive?  (docs/stall-free.md)

Each configuration gets a server of its own, one after the other (stall-free prefill on,
then off, by default), and two phases on it:

- *quiet*: ``streams`` clients each decode long answers back to back, while short
  questions (probes) arrive one at a time;
- *long prompts*: the same, while prompts of ``long_min_tokens``-``long_max_tokens``
  tokens (unique text, so the prefix cache holds none of it) arrive every
  ``long_interval_seconds``.

Measured: the streams' inter-token gaps (p50, p99, max), the probes' time to first token
in each phase and its ratio, the long prompts' time to first token, and admission's
predicted time to first token against the measured one (each answer's final usage event
carries the prediction, ``sluicegate.predicted_ttft_seconds``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from sluicegate.bench.peer_engine import wait_compiled
from sluicegate.bench.server_process import start_server_with_args

#: The configurations compared, by label: the server flags of each.
CONFIGS: dict[str, tuple[str, ...]] = {
    "stall-free": ("--stall-free-prefill",),
    "one budget": ("--no-stall-free-prefill",),
}
_WORDS = [
    "river",
    "mountain",
    "signal",
    "harbor",
    "lantern",
    "copper",
    "meadow",
    "engine",
    "silver",
    "orchard",
    "basket",
    "thunder",
    "canvas",
    "pocket",
    "garden",
    "marble",
    "window",
    "ladder",
    "candle",
    "forest",
]


@dataclass(slots=True)
class Answer:
    status: int
    ttft: float | None = None
    predicted: float | None = None
    prompt_tokens: int = 0
    gaps: list[float] = field(default_factory=list)


@dataclass(slots=True)
class PhaseResult:
    gaps: list[float] = field(default_factory=list)
    probe_ttft: list[float] = field(default_factory=list)
    probes_refused: int = 0
    long_ttft: list[float] = field(default_factory=list)
    long_predicted: list[float] = field(default_factory=list)
    long_prompt_tokens: list[int] = field(default_factory=list)
    long_refused: int = 0
    streams_refused: int = 0
    #: Tokens the streams received, and the phase's length: their throughput.
    stream_tokens: int = 0
    seconds: float = 0.0

    @property
    def stream_tokens_per_second(self) -> float | None:
        return self.stream_tokens / self.seconds if self.seconds > 0 else None


@dataclass(slots=True)
class ConfigResult:
    label: str
    quiet: PhaseResult
    loaded: PhaseResult
    stats: dict[str, Any]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def _answer(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, keep_gaps: bool
) -> Answer:
    """One streamed chat answer of exactly ``max_tokens`` tokens: its TTFT, its gaps, the
    predicted TTFT and its prompt's tokens from the final usage event."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    last: float | None = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        answer = Answer(response.status_code)
        if response.status_code != 200:
            await response.aread()
            return answer
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            usage = event.get("usage")
            if isinstance(usage, dict):
                answer.prompt_tokens = int(usage.get("prompt_tokens", 0))
                timing = usage.get("sluicegate") or {}
                answer.predicted = timing.get("predicted_ttft_seconds")
            if "error" in event:
                answer.status = 599
            choices = event.get("choices") or []
            if not choices or not (choices[0].get("delta") or {}).get("content"):
                continue
            now = time.monotonic()
            if last is None:
                answer.ttft = now - started
            elif keep_gaps:
                answer.gaps.append(now - last)
            last = now
    return answer


def long_prompt(rng: random.Random, num_words: int) -> str:
    """Unique text of about ``num_words`` words (one token each, or near)."""
    words = [rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(num_words)]
    return "Summarize these notes in one line: " + " ".join(words)


@dataclass(slots=True, frozen=True)
class Load:
    """What a phase offers (see the module's docstring)."""

    streams: int = 4
    stream_tokens: int = 150
    probe_interval_seconds: float = 1.5
    #: Seconds between long prompts (None: none).
    long_interval_seconds: float | None = None
    long_words: tuple[int, int] = (650, 1740)
    seed: int = 7


async def run_phase(base_url: str, seconds: float, load: Load) -> PhaseResult:
    """``load.streams`` clients decoding back to back for ``seconds``, short probes, and
    long prompts every ``load.long_interval_seconds``."""
    result = PhaseResult(seconds=seconds)
    rng = random.Random(load.seed)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:

        async def stream(k: int) -> None:
            await asyncio.sleep(0.3 * k)  # not all at once: a burst is not what is measured
            n = 0
            while time.monotonic() < deadline:
                prompt = f"Tell me a long story about the {rng.choice(_WORDS)} number {k}-{n}."
                answer = await _answer(client, prompt, load.stream_tokens, keep_gaps=True)
                n += 1
                if answer.status == 200:
                    result.gaps.extend(answer.gaps)
                    result.stream_tokens += len(answer.gaps) + (answer.ttft is not None)
                else:
                    result.streams_refused += 1
                    await asyncio.sleep(1.0)

        async def probes() -> None:
            await asyncio.sleep(min(2.0, seconds / 4))
            while time.monotonic() < deadline:
                question = f"What is {rng.randrange(100)} plus {rng.randrange(100)}?"
                answer = await _answer(client, question, 4, keep_gaps=False)
                if answer.status == 200 and answer.ttft is not None:
                    result.probe_ttft.append(answer.ttft)
                else:
                    result.probes_refused += 1
                await asyncio.sleep(load.probe_interval_seconds * rng.uniform(0.5, 1.5))

        async def one_long(prompt: str) -> None:
            answer = await _answer(client, prompt, 8, keep_gaps=False)
            if answer.status == 200 and answer.ttft is not None:
                result.long_ttft.append(answer.ttft)
                result.long_prompt_tokens.append(answer.prompt_tokens)
                if answer.predicted is not None:
                    result.long_predicted.append(answer.predicted)
            else:
                result.long_refused += 1

        async def longs(interval: float) -> None:
            sent: list[asyncio.Task[None]] = []
            # After the streams have started; none so late that it is not answered in time.
            await asyncio.sleep(min(3.0, seconds / 4))
            while time.monotonic() < deadline - min(2.0, seconds / 4):
                prompt = long_prompt(rng, rng.randint(*load.long_words))
                sent.append(asyncio.create_task(one_long(prompt)))
                await asyncio.sleep(interval * rng.uniform(0.7, 1.3))
            await asyncio.gather(*sent)

        tasks = [stream(k) for k in range(load.streams)]
        tasks.append(probes())
        if load.long_interval_seconds is not None:
            tasks.append(longs(load.long_interval_seconds))
        await asyncio.gather(*tasks)
    return result


def run(
    out: Path,
    *,
    configs: Sequence[str] = tuple(CONFIGS),
    phase_seconds: float = 40.0,
    streams: int = 4,
    stream_tokens: int = 150,
    probe_interval_seconds: float = 1.5,
    long_interval_seconds: float = 8.0,
    long_tokens: tuple[int, int] = (1500, 4000),
    extra_args: Sequence[str] = (),
) -> list[ConfigResult]:
    """Each configuration on a server of its own: the quiet phase, then long prompts."""
    out.mkdir(parents=True, exist_ok=True)
    # A word of the generated text is about 2.3 SmolLM2 tokens.
    words = (long_tokens[0] * 10 // 23, long_tokens[1] * 10 // 23)
    max_len = str(max(2048, long_tokens[1] + 512))
    results = []
    for label in configs:
        args = [*CONFIGS[label], "--max-model-len", max_len, "--max-num-seqs", "16", *extra_args]
        slug = label.replace(" ", "-")
        server = start_server_with_args(args, out / f"server-{slug}.log")
        try:
            # Measured as it serves once warm: the compiled decode step in use (its first
            # build takes minutes, on one thread of the engine's two meanwhile).
            wait_compiled(server.base_url)
            server.wait_calibrated()
            quiet_load = Load(streams, stream_tokens, probe_interval_seconds, None, words)
            quiet = asyncio.run(run_phase(server.base_url, phase_seconds, quiet_load))
            loaded_load = replace(quiet_load, long_interval_seconds=long_interval_seconds)
            loaded = asyncio.run(run_phase(server.base_url, phase_seconds, loaded_load))
            results.append(ConfigResult(label, quiet, loaded, server.stats()))
        finally:
            server.stop()
    (out / "long-prompts.json").write_text(
        json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8"
    )
    return results


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def prediction_errors(result: PhaseResult) -> list[float]:
    """Each long prompt's |measured - predicted| / measured time to first token."""
    pairs = zip(result.long_ttft, result.long_predicted, strict=False)
    return [abs(m - p) / m for m, p in pairs if m > 0]


def table(results: Sequence[ConfigResult]) -> list[str]:
    """The figures, a row per configuration."""
    lines = [
        "| config | stream gap p50 / p99 / max, quiet (ms) | with long prompts (ms) | "
        "probe TTFT p99 quiet → long (ms, ratio) | long prompts: admitted, refused, "
        "TTFT p50 / p90 (s) | predicted TTFT error p90 | stream tokens/s, quiet |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        q, lp = r.quiet, r.loaded
        quiet_probe, loaded_probe = percentile(q.probe_ttft, 0.99), percentile(lp.probe_ttft, 0.99)
        ratio = (
            f"{loaded_probe / quiet_probe:.2f}x"
            if quiet_probe is not None and loaded_probe is not None
            else "-"
        )
        p50, p90 = percentile(lp.long_ttft, 0.5), percentile(lp.long_ttft, 0.9)
        error = percentile(prediction_errors(lp), 0.9)
        lines.append(
            f"| {r.label} "
            f"| {_ms(percentile(q.gaps, 0.5))} / {_ms(percentile(q.gaps, 0.99))} / "
            f"{_ms(max(q.gaps, default=None))} "
            f"| {_ms(percentile(lp.gaps, 0.5))} / {_ms(percentile(lp.gaps, 0.99))} / "
            f"{_ms(max(lp.gaps, default=None))} "
            f"| {_ms(quiet_probe)} → {_ms(loaded_probe)} ({ratio}) "
            f"| {len(lp.long_ttft)}, {lp.long_refused}, "
            f"{'-' if p50 is None else f'{p50:.1f}'} / {'-' if p90 is None else f'{p90:.1f}'} "
            f"| {'-' if error is None else f'{error:.0%}'} "
            f"| {_rate(q.stream_tokens_per_second)} |"
        )
    return lines
