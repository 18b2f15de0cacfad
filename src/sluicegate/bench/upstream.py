"""Direct to an engine, then through Sluicegate in front of it: the same seeded load.

``sluicegate bench upstream U.yaml --scenario overload`` starts the engine server from
``U.yaml`` (any ``sluicegate serve`` config: the sim engine, say, standing in for a GPU
engine), drives the scenario at it directly, then starts it afresh with a gateway
(``--engine upstream``, the settings of ``--gateway G.yaml`` if given) in front of it and
drives the same schedule through the gateway.  The runs are in turn, never at once.
``--two-gateways`` adds a third run: two gateway replicas sharing a Redis in front of a
fresh engine, each sent every other request (what a round-robin balancer does).
The engine runs with admission ``static`` and no breaker unless ``U.yaml`` says
otherwise: a plain engine, which queues what it cannot run, like vLLM or llama.cpp.

``--llama-server BIN`` fronts llama.cpp's own server instead (the same SmolLM2 GGUF,
2 threads, ``--llama-slots`` slots, its metrics on): a real engine, with its own slots,
queue and prefill cost, in each run a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from sluicegate.bench.capacity import CapacityResult
from sluicegate.bench.client import Target
from sluicegate.bench.compare import Outputs, headline_line, measure_capacity, write_outputs
from sluicegate.bench.prefix import run_llama_server
from sluicegate.bench.resume_latency import redis_for_bench
from sluicegate.bench.runner import Runner, RunResult
from sluicegate.bench.scenario import Scenario
from sluicegate.bench.schedule import Schedule, build_schedule
from sluicegate.bench.server_process import ServerProcess, server_settings, start_server

#: What makes a Sluicegate server behave like a plain engine (unless its config says).
PLAIN_ENGINE = {"admission": "static", "breaker": False, "max_queue_wait_seconds": 600.0}


def _write(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


@dataclass(slots=True, frozen=True)
class LlamaServer:
    """llama.cpp's server as the engine: its binary and slots (``-np``), each slot with
    ``slot_context`` tokens."""

    binary: str
    slots: int = 8
    slot_context: int = 2048

    def args(self) -> list[str]:
        context = str(self.slots * self.slot_context)
        return ["-np", str(self.slots), "-c", context, "--metrics"]


def _engine_starter(
    upstream_config: Path | None, llama: LlamaServer | None, out_dir: Path, ready: float
) -> tuple[str, Callable[[str], contextlib.AbstractContextManager[str]]]:
    """What the engine is (for the console) and how to start a fresh one (its base URL)."""
    if llama is not None:

        @contextlib.contextmanager
        def start_llama(label: str) -> Iterator[str]:
            with run_llama_server(
                llama.binary, out_dir / f"llama-server-{label}.log", llama.args()
            ) as url:
                yield url

        return f"llama-server {' '.join(llama.args())}", start_llama
    if upstream_config is None:
        raise ValueError("give an engine config or --llama-server")
    engine_values = {**PLAIN_ENGINE, **server_settings(upstream_config)}
    engine_path = _write(out_dir / "engine.yaml", engine_values)

    @contextlib.contextmanager
    def start_config(label: str) -> Iterator[str]:
        log = out_dir / f"server-{label}.log"
        with start_server(engine_path, log, ready_timeout_seconds=ready) as engine:
            yield engine.base_url

    return str(engine_values), start_config


def run_upstream_compare(
    scenario: Scenario,
    upstream_config: Path | None,
    out_dir: Path,
    *,
    llama_server: LlamaServer | None = None,
    gateway_config: Path | None = None,
    duration_seconds: float | None = None,
    capacity_rps: float | None = None,
    seed: int | None = None,
    console: Console | None = None,
    show_progress: bool = True,
    ready_timeout_seconds: float = 180.0,
    two_gateways: bool = False,
) -> tuple[list[RunResult], CapacityResult | None, Outputs]:
    console = console or Console(stderr=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    what, start_engine = _engine_starter(
        upstream_config, llama_server, out_dir, ready_timeout_seconds
    )
    gateway_values = server_settings(gateway_config) if gateway_config else {}
    results: list[RunResult] = []
    capacity: CapacityResult | None = None
    schedule: Schedule | None = None

    def drive(label: str, base_url: str, *more_urls: str) -> None:
        nonlocal capacity, capacity_rps, schedule
        runner = Runner(
            Target.parse(base_url),
            scenario,
            console=console,
            show_progress=show_progress,
            more_targets=tuple(Target.parse(url) for url in more_urls),
        )
        if schedule is None:
            if scenario.needs_capacity and capacity_rps is None:
                console.print(f"  measuring capacity {label} (used for both runs)")
                capacity = measure_capacity(runner, console)
                capacity_rps = capacity.capacity_rps
            schedule = build_schedule(
                scenario, seed=seed, capacity_rps=capacity_rps, duration_seconds=duration_seconds
            )
        console.print(f"  driving {label} with {len(schedule.requests)} requests")
        result = runner.run(schedule, label, capacity_rps=capacity_rps)
        results.append(result)
        console.print("  " + headline_line(label, result.summary()["all"]), highlight=False)

    phases = 3 if two_gateways else 2
    console.print(f"[bold][1/{phases}] direct[/bold]: the engine alone ({what})")
    with start_engine("direct") as engine_url:
        drive("direct", engine_url)
    console.print(f"[bold][2/{phases}] gateway[/bold]: Sluicegate in front of a fresh engine")
    with start_engine("upstream") as engine_url:
        gateway_path = _write(
            out_dir / "gateway.yaml",
            {**gateway_values, "engine": "upstream", "upstream": [engine_url]},
        )
        with start_server(
            gateway_path,
            out_dir / "server-gateway.log",
            ready_timeout_seconds=ready_timeout_seconds,
        ) as gateway:
            drive("gateway", gateway.base_url)
    if two_gateways:
        console.print(
            f"[bold][3/{phases}] two gateways[/bold]: two replicas sharing a Redis in front "
            "of a fresh engine, each sent every other request"
        )
        with (
            start_engine("upstream-shared") as engine_url,
            redis_for_bench(out_dir, None) as redis_url,
        ):
            values = {**gateway_values, "engine": "upstream", "upstream": [engine_url]}
            values["store"] = redis_url
            path = _write(out_dir / "gateway-replica.yaml", values)
            with contextlib.ExitStack() as held:
                replicas = [
                    held.enter_context(
                        start_server(
                            path,
                            out_dir / f"server-gateway-replica-{i}.log",
                            ready_timeout_seconds=ready_timeout_seconds,
                        )
                    )
                    for i in (1, 2)
                ]
                drive("two gateways", replicas[0].base_url, replicas[1].base_url)
    return results, capacity, write_outputs(out_dir, results, capacity)


def ratio_lines(results: Sequence[RunResult]) -> list[str]:
    """Gateway against direct: TTFT, TPOT, throughput and goodput."""
    by_label = {r.label: r.summary()["all"] for r in results}
    direct, gateway = by_label.get("direct"), by_label.get("gateway")
    if direct is None or gateway is None:
        return []
    lines = []
    for name, d, g in (
        (
            "TTFT p50",
            direct.ttft.p50 if direct.ttft else None,
            gateway.ttft.p50 if gateway.ttft else None,
        ),
        (
            "TTFT p99",
            direct.ttft.p99 if direct.ttft else None,
            gateway.ttft.p99 if gateway.ttft else None,
        ),
        (
            "TPOT p50",
            direct.tpot.p50 if direct.tpot else None,
            gateway.tpot.p50 if gateway.tpot else None,
        ),
    ):
        if d is not None and g is not None:
            lines.append(
                f"{name}: direct {d * 1e3:.1f} ms, gateway {g * 1e3:.1f} ms "
                f"(gateway - direct {(g - d) * 1e3:+.1f} ms, ratio {g / max(d, 1e-9):.2f})"
            )
    lines.append(
        f"goodput: direct {direct.goodput_rps:.2f} req/s, gateway {gateway.goodput_rps:.2f} "
        f"req/s (ratio {gateway.goodput_rps / max(direct.goodput_rps, 1e-9):.2f})"
    )
    return lines


@dataclass(slots=True)
class RelayResult:
    """Streams relayed at full speed: tokens per second, and per CPU-second of a server."""

    label: str
    streams: int
    tokens: int
    seconds: float
    cpu_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def tokens_per_cpu_second(self) -> float:
        return self.tokens / max(self.cpu_seconds, 1e-9)

    def line(self) -> str:
        return (
            f"{self.label}: {self.streams} streams, {self.tokens} tokens in "
            f"{self.seconds:.2f} s = {self.tokens_per_second:,.0f} tokens/s; "
            f"{self.cpu_seconds:.2f} CPU-s of the measured server = "
            f"{self.tokens_per_cpu_second:,.0f} tokens per CPU-second"
        )


async def _stream_all(base_url: str, streams: int, max_tokens: int) -> int:
    """Open ``streams`` streamed completions at once, read them whole; the tokens."""
    body = {
        "prompt": "relay",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def one(client: httpx.AsyncClient, i: int) -> int:
        tail = b""
        request = {**body, "prompt": f"relay {i}"}
        async with client.stream("POST", base_url + "/v1/completions", json=request) as r:
            if r.status_code != 200:
                raise RuntimeError(f"stream {i} answered {r.status_code}: {await r.aread()!r}")
            async for chunk in r.aiter_bytes():
                tail = (tail + chunk)[-4096:]
        usage = tail.rsplit(b'"usage":', 1)[-1]
        return int(usage.split(b'"completion_tokens":', 1)[1].split(b",", 1)[0])

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        counts = await asyncio.gather(*(one(client, i) for i in range(streams)))
    return sum(counts)


async def _first_token_seconds(base_url: str, count: int) -> list[float]:
    """``count`` streamed one-token answers in turn: the time to each first token."""
    body = {"prompt": "ping", "max_tokens": 4, "stream": True}
    times = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(count):
            started = time.perf_counter()
            async with client.stream("POST", base_url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter() - started)
                        break
    return times


def ttft_line(label: str, times: Sequence[float]) -> str:
    ordered = sorted(times)
    p50, p90 = ordered[len(ordered) // 2], ordered[int(0.9 * (len(ordered) - 1))]
    return f"{label}: TTFT p50 {p50 * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms ({len(ordered)} in turn)"


def _cpu_seconds(server: ServerProcess) -> float:
    return server.metrics().total("process_cpu_seconds_total")


def relay_throughput(
    out_dir: Path, *, streams: int = 32, max_tokens: int = 2000, console: Console | None = None
) -> list[RelayResult]:
    """A sim engine as fast as it goes (0.1 ms steps), streamed from directly and then
    through a gateway (default flush: chunks of 40 ms or 24 tokens): tokens per second,
    and tokens per CPU-second of the engine (direct) and of the gateway (through)."""
    console = console or Console(stderr=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine_path = _write(
        out_dir / "relay-engine.yaml",
        {
            **PLAIN_ENGINE,
            "engine": "sim",
            "sim_step_base_ms": 0.1,
            "sim_step_per_token_ms": 0.0,
            "max_num_seqs": streams,
            "max_num_batched_tokens": max(512, streams),
            "max_model_len": max_tokens + 64,
        },
    )
    results = []
    with start_server(engine_path, out_dir / "server-relay-engine.log") as engine:
        asyncio.run(_stream_all(engine.base_url, 4, 50))  # warm
        console.print(ttft_line("direct", asyncio.run(_first_token_seconds(engine.base_url, 200))))
        cpu, started = _cpu_seconds(engine), time.monotonic()
        tokens = asyncio.run(_stream_all(engine.base_url, streams, max_tokens))
        seconds, used = time.monotonic() - started, _cpu_seconds(engine) - cpu
        results.append(RelayResult("direct (engine's CPU)", streams, tokens, seconds, used))
        console.print(results[-1].line())
        gateway_path = _write(
            out_dir / "relay-gateway.yaml",
            {
                "engine": "upstream",
                "upstream": [engine.base_url],
                "upstream_tokenizer": "bytes",
                "upstream_max_concurrent": streams,
                "admission": "static",
                "max_num_seqs": streams,
            },
        )
        with start_server(gateway_path, out_dir / "server-relay-gateway.log") as gateway:
            asyncio.run(_stream_all(gateway.base_url, 4, 50))  # warm
            through = asyncio.run(_first_token_seconds(gateway.base_url, 200))
            console.print(ttft_line("through the gateway", through))
            # The engine alone again, now that the gateway shares the machine too.
            again = asyncio.run(_first_token_seconds(engine.base_url, 200))
            console.print(ttft_line("direct, gateway running", again))
            cpu, started = _cpu_seconds(gateway), time.monotonic()
            tokens = asyncio.run(_stream_all(gateway.base_url, streams, max_tokens))
            seconds, used = time.monotonic() - started, _cpu_seconds(gateway) - cpu
            label = "through the gateway (gateway's CPU)"
            results.append(RelayResult(label, streams, tokens, seconds, used))
            console.print(results[-1].line())
    return results
