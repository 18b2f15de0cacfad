"""``sluicegate bench engine-peer``: the embedded engine through the real server against
llama.cpp's ``llama-server`` on the same GGUF, side by side (docs/engine-performance.md).

For each server in turn (ours with ``--max-num-seqs 32`` in each of its configurations,
:data:`CONFIGS`, the defaults once their compiled package is built, each once its start-up
calibration is complete; llama-server with 2 threads and 32 slots): closed-loop streams
at 1, 8 and 32 at once, each asking for 128-token answers (``ignore_eos``) back to back
for ``seconds``; output tokens per second over the window, and TTFT p50.  Then the prompt
rate: 512-token prompts no cache has seen, one at a time, prompt tokens over time to
first token.  Without a binary the peer is skipped with one line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from sluicegate.bench.prefix import run_llama_server
from sluicegate.bench.server_process import start_server_with_args

CONCURRENCY = (1, 8, 32)
#: Words of the prompt-rate prompts: about 512 tokens with the chat template.
PROMPT_WORDS = 400
WORDS = [
    "river",
    "gate",
    "water",
    "flow",
    "lock",
    "valve",
    "pressure",
    "channel",
    "basin",
    "weir",
    "canal",
    "dam",
    "spillway",
    "turbine",
    "sluice",
    "reservoir",
    "current",
    "tide",
    "level",
    "meter",
    "gauge",
    "stream",
    "bank",
    "ditch",
]


@dataclass(slots=True)
class Point:
    streams: int
    tokens_per_second: float
    ttft_p50: float
    requests: int
    refused: int


@dataclass(slots=True)
class PeerRun:
    label: str
    points: list[Point] = field(default_factory=list)
    #: Prompt tokens per second to the first token, uncached prompts of ``prompt_tokens``.
    prompt_rate: float = 0.0
    prompt_tokens: int = 0
    #: Seconds from launching the server to its ``/ready`` (our servers).
    ready_seconds: float = 0.0
    #: Seconds from launching the server to its compiled decode step in use, and whether
    #: it had to build the package first (else it loaded it).
    compiled_seconds: float = 0.0
    built: bool = False
    #: The server's own report of its single-stream decode rate (llama-server's
    #: ``timings.predicted_per_second``: its kernels, no HTTP); 0 when it reports none.
    own_decode_rate: float = 0.0


async def _one(
    client: httpx.AsyncClient, body: dict[str, object]
) -> tuple[int, float | None, float | None]:
    """(output tokens, TTFT, retry-after when refused) of one streamed chat."""
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code == 429:
            await response.aread()
            return 0, None, float(response.headers.get("retry-after") or 1)
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            usage = event.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or tokens)
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                first = first or time.monotonic() - started
    return tokens, first, None


async def _closed_loop(base_url: str, streams: int, seconds: float, max_tokens: int) -> Point:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    tokens = 0
    ttfts: list[float] = []
    requests = refused = 0
    deadline = time.monotonic() + seconds

    async def worker(client: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens, requests, refused
        n = 0
        while time.monotonic() < deadline:
            n += 1
            words = " ".join(WORDS[(index * 7 + n * 3 + k) % len(WORDS)] for k in range(12))
            body = {
                "messages": [{"role": "user", "content": f"Tell a story about: {words}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0.7,
                "seed": index * 1000 + n,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            got, first, retry = await _one(client, body)
            if retry is not None:
                refused += 1
                await asyncio.sleep(min(retry, max(0.0, deadline - time.monotonic())))
                continue
            requests += 1
            tokens += got
            if first is not None:
                ttfts.append(first)

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client, i) for i in range(streams)))
    elapsed = time.monotonic() - started
    ttft = statistics.median(ttfts) if ttfts else 0.0
    return Point(streams, tokens / elapsed, ttft, requests, refused)


async def _prompt_rate(base_url: str, count: int, prompt_words: int) -> tuple[float, int]:
    """Prompt tokens per second to the first token, for prompts no cache has seen (and
    the prompts' length in tokens)."""
    rates = []
    prompt_tokens = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for i in range(count):
            words = " ".join(WORDS[(i * 5 + k * k) % len(WORDS)] for k in range(prompt_words))
            body = {
                "messages": [{"role": "user", "content": f"{i} {words}"}],
                "max_tokens": 1,
                "stream": True,
                "stream_options": {"include_usage": True},
                "cache_prompt": False,  # llama-server: do not reuse an earlier prompt
            }
            for attempt in range(2):
                try:
                    rate, prompt_tokens = await _one_prompt(client, body)
                    break
                except httpx.RemoteProtocolError as error:
                    # A kept-alive connection the server closed as the request went out
                    # (seen with llama-server): asked again on a new one, timed afresh.
                    if attempt:
                        raise
                    print(f"prompt rate: {error!r}; asking again", flush=True)
            rates.append(rate)
    return statistics.median(rates), prompt_tokens


async def _one_prompt(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, int]:
    """One prompt's tokens per second to its first token, and its length in tokens."""
    started = time.monotonic()
    prompt_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = orjson.loads(line[6:]).get("usage")
                if usage:
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    return prompt_tokens / (time.monotonic() - started), prompt_tokens


async def _own_decode_rate(base_url: str, max_tokens: int, count: int = 3) -> float:
    """Median of the server's own decode rate over ``count`` single answers, where it
    reports one (llama-server's ``timings``); 0.0 otherwise, or when it cannot be read
    (a side figure: it never fails the run)."""
    rates: list[float] = []
    for i in range(2 * count):  # a dropped connection is asked again
        if len(rates) == count:
            break
        body = {
            "messages": [{"role": "user", "content": f"Tell a story about: {WORDS[i]}"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": i,
        }
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
                response = await client.post("/v1/chat/completions", json=body)
            timings = response.json().get("timings") or {}
        except (httpx.HTTPError, ValueError) as error:
            print(f"own decode rate: {error!r}; asking again", flush=True)
            await asyncio.sleep(1.0)
            continue
        rate = timings.get("predicted_per_second")
        if rate is None:
            return 0.0
        rates.append(float(rate))
    return statistics.median(rates) if rates else 0.0


def _measure(label: str, base_url: str, seconds: float, max_tokens: int) -> PeerRun:
    run = PeerRun(label)
    asyncio.run(_closed_loop(base_url, 1, 3.0, 16))  # first-use costs
    for streams in CONCURRENCY:
        run.points.append(asyncio.run(_closed_loop(base_url, streams, seconds, max_tokens)))
    run.prompt_rate, run.prompt_tokens = asyncio.run(_prompt_rate(base_url, 5, PROMPT_WORDS))
    run.own_decode_rate = asyncio.run(_own_decode_rate(base_url, max_tokens))
    return run


#: Our servers, by label: the defaults (the compiled decode step: built once, then loaded
#: at start; measured once ready), always eager (``--engine-compile off``), 4-bit weights
#: for answers (``--weights q4``, compiled too), and one token budget a step instead of
#: stall-free prefill (what stall-free prefill costs in throughput).
CONFIGS: dict[str, list[str]] = {
    "sluicegate": [],
    "sluicegate eager": ["--engine-compile", "off"],
    "sluicegate q4": ["--weights", "q4"],
    "sluicegate one budget": ["--no-stall-free-prefill"],
}
#: Measured when no configuration is named.
DEFAULT_CONFIGS = ("sluicegate", "sluicegate eager", "sluicegate q4")


def wait_compiled(base_url: str, timeout: float = 900.0) -> bool:
    """Until the server's compiled decode step is ready (a first build takes minutes, a
    load seconds); False when it has none (off, or a model it does not compile)."""
    deadline = time.monotonic() + timeout
    while True:
        status: str = httpx.get(f"{base_url}/v1/stats", timeout=30).json()["engine_compile"]
        if status in ("ready", "off"):
            return status == "ready"
        if status not in ("building", "loading") or time.monotonic() > deadline:
            raise RuntimeError(f"the compiled decode step is {status}")
        # Steps look at the build and the load: one short request at a time.
        asyncio.run(_closed_loop(base_url, 1, 0.2, 4))
        time.sleep(0.1 if status == "loading" else 3)


def engine_vs_peer(
    out: Path,
    llama_server_binary: str | None,
    seconds: float = 30.0,
    max_tokens: int = 128,
    configs: Sequence[str] = DEFAULT_CONFIGS,
) -> list[PeerRun]:
    """Each of our ``configs`` (labels of :data:`CONFIGS`) in turn, then llama-server."""
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for label in configs:
        extra = CONFIGS[label]
        launched = time.monotonic()
        # The benchmark's own environment does not decide the server's compiled step.
        env = {"SLUICEGATE_ENGINE_COMPILE": "decode"}
        args = ["--max-num-seqs", "32", *extra]
        server = start_server_with_args(args, out / f"{label}.log", env=env)
        ready = time.monotonic() - launched
        try:
            compiles = wait_compiled(server.base_url)
            compiled = time.monotonic() - launched
            # A first fit from three shapes timed once can be far off on a shared machine,
            # and under load from the first second it sizes the seats for minutes (two
            # runs of one configuration measured 68 and 196 tokens/s at 32 streams).
            if not server.wait_calibrated():
                raise RuntimeError("the server's calibration did not complete while idle")
            run = _measure(label, server.base_url, seconds, max_tokens)
            run.ready_seconds = ready
            if compiles:
                run.compiled_seconds = compiled
                run.built = "building in the background" in server.log()
            runs.append(run)
        finally:
            server.stop()
    if llama_server_binary:
        # 2 threads, 32 slots of 1,024 tokens.
        slots = ("-np", "32", "-c", str(1024 * 32))
        with run_llama_server(llama_server_binary, out / "llama-server.log", slots) as base_url:
            runs.append(_measure("llama-server", base_url, seconds, max_tokens))
    document = [dataclasses.asdict(r) for r in runs]
    (out / "results.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return runs


def table(runs: Sequence[PeerRun]) -> list[str]:
    """Output tokens/s of each run at each concurrency, and each of ours against the peer."""
    peer = runs[-1] if runs[-1].label == "llama-server" else None
    ours = [r for r in runs if r is not peer]
    head = "| concurrent streams | " + " | ".join(f"{r.label} tok/s" for r in runs)
    ratios = [f"{r.label} / llama-server" for r in ours] if peer else []
    lines = [
        head + "".join(f" | {name}" for name in ratios) + " | TTFT p50 |",
        "|---" * (2 + len(runs) + len(ratios)) + "|",
    ]
    for i, point in enumerate(ours[0].points):
        cells = [f"{r.points[i].tokens_per_second:.1f}" for r in runs]
        if peer is not None:
            theirs = peer.points[i].tokens_per_second or float("nan")
            cells += [f"**{r.points[i].tokens_per_second / theirs:.2f}**" for r in ours]
        ttft = " / ".join(f"{r.points[i].ttft_p50 * 1000:.0f}" for r in runs)
        lines.append(f"| {point.streams} | " + " | ".join(cells) + f" | {ttft} ms |")
    lines.append("")
    for run in ours:
        lines.append(
            f"prompt rate, {run.label} ({run.prompt_tokens}-token prompts, uncached): "
            f"{run.prompt_rate:.0f} tokens/s"
            + (
                f" vs {peer.prompt_rate:.0f} ({run.prompt_rate / peer.prompt_rate:.2f}x)"
                if peer
                else ""
            )
        )
        refused = sum(p.refused for p in run.points)
        if refused:
            lines.append(
                f"{run.label} refused {refused} requests (429), each retried after Retry-After"
            )
        lines.append(f"start-up, {run.label}: ready {run.ready_seconds:.1f} s after launch")
        if run.compiled_seconds:
            how = "built, then loaded" if run.built else "loaded from the cache"
            lines.append(
                f"compiled decode step in use {run.compiled_seconds:.1f} s after launch ({how})"
            )
    if peer is None:
        lines.append("llama-server: skipped (no --peer-llama-server binary)")
    elif peer.own_decode_rate:
        # What any engine over llama.cpp's kernels could reach at one stream.
        best = max(ours, key=lambda r: r.points[0].tokens_per_second)
        lines.append(
            f"llama-server's own one-stream decode rate (its timings: kernels, no HTTP): "
            f"{peer.own_decode_rate:.0f} tokens/s, against {peer.points[0].tokens_per_second:.0f}"
            f" through HTTP; {best.label} at one stream: "
            f"{best.points[0].tokens_per_second / peer.own_decode_rate:.2f}x it"
        )
    return lines
