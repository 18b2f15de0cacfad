"""``sluicegate bench startup``: how long the embedded engine takes to serve after launch.

Four starts of ``sluicegate serve`` (the default engine, SmolLM2): with an empty cache
directory (cold: the weights are converted and the calibration measured) and again with
the one it left (warm), each on a quiet machine and with one core kept busy by a
CPU-bound process the bench starts (a Python busy loop, its own process, stopped after
the start).  For each: seconds from launch to ``/ready``, then the time to first token of
one short chat answer asked at once, the seconds until the calibration the engine
finishes while idle is complete (``/v1/stats``), and then the time per output token of
two streams of 64 tokens at once with the torch threads the engine chose (a step's
time beside the busy core, against the quiet one's).  One run each: the machine's noise
is in every figure, and the side-by-side ratios (busy over quiet) are what to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from sluicegate.bench.server_process import ServerProcess, start_server_with_args

#: A busy core: a process that computes and never waits.
_BUSY_LOOP = "while True: pass"
#: Streams at once, and the output tokens of each, of the decode-speed figure.
STREAMS = 2
TOKENS = 64
#: Seconds to wait for the calibration to finish in the background before giving up.
CALIBRATION_TIMEOUT_SECONDS = 180.0


@dataclasses.dataclass(slots=True)
class StartRun:
    """One start: the condition and its times, in seconds from launch."""

    label: str
    cache: str
    busy_core: bool
    ready_seconds: float = 0.0
    #: The first answer's time to first token, asked as soon as the server was ready.
    first_ttft_seconds: float = 0.0
    #: Until ``/v1/stats`` showed the calibration complete (-1: not within the timeout).
    calibrated_seconds: float = -1.0
    #: Mean time per output token of :data:`STREAMS` streams of :data:`TOKENS` tokens.
    tpot_seconds: float = 0.0
    #: Streams of those refused (429): none is expected of two on an idle server.
    refused: int = 0
    #: The torch threads the engine ran with then, and other processes' cores it saw.
    threads: int = 0
    other_processes_cores: float = 0.0

    def line(self) -> str:
        calibrated = (
            f"{self.calibrated_seconds:.1f} s"
            if self.calibrated_seconds >= 0
            else f"not in {CALIBRATION_TIMEOUT_SECONDS:g} s"
        )
        return (
            f"{self.label}: ready {self.ready_seconds:.1f} s after launch, first answer's "
            f"TTFT {self.first_ttft_seconds:.2f} s, calibration complete {calibrated}; "
            f"{STREAMS} streams: TPOT {1000 * self.tpot_seconds:.0f} ms ({self.refused} "
            f"refused) on {self.threads} thread(s), others using "
            f"{self.other_processes_cores:.2f} cores"
        )


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """A CPU-bound process for the block's duration (nothing when not ``enabled``)."""
    if not enabled:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
    try:
        time.sleep(0.5)  # on the CPU before the server starts
        yield
    finally:
        hog.kill()
        hog.wait()


def startup(out: Path, extra_args: list[str] | None = None) -> list[StartRun]:
    """Cold then warm, quiet then with a busy core (four starts)."""
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    # The cache directories and job journals are the servers' scratch: not results.
    with tempfile.TemporaryDirectory(prefix="sluicegate-startup-") as scratch:
        for busy in (False, True):
            cache = Path(scratch) / ("cache-busy" if busy else "cache-quiet")
            for kind in ("cold", "warm"):
                label = f"{kind}, {'one core busy' if busy else 'quiet'}"
                run = StartRun(label, kind, busy)
                with busy_core(busy):
                    _start(run, cache, out, Path(scratch), extra_args or [])
                runs.append(run)
    document = [dataclasses.asdict(run) for run in runs]
    (out / "results.json").write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return runs


def _start(run: StartRun, cache: Path, out: Path, scratch: Path, extra_args: list[str]) -> None:
    name = run.label.replace(", ", "-").replace(" ", "-")
    args = [
        "--cache-dir",
        str(cache),
        "--journal-path",
        str(scratch / f"jobs-{name}.sqlite3"),
        *extra_args,
    ]
    launched = time.monotonic()
    server = start_server_with_args(args, out / f"{name}.log", ready_timeout_seconds=600)
    run.ready_seconds = time.monotonic() - launched
    try:
        run.first_ttft_seconds = _first_token_seconds(server)
        run.calibrated_seconds = _calibrated(server, launched)
        run.tpot_seconds, run.refused = asyncio.run(_decode_tpot(server))
        cpu = server.stats().get("cpu", {})
        run.threads = int(cpu.get("threads", 0))
        run.other_processes_cores = float(cpu.get("other_processes_cores", 0.0))
    finally:
        server.stop()


def _first_token_seconds(server: ServerProcess) -> float:
    body = {
        "model": str(server.stats()["model"]),
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "stream": True,
    }
    asked = time.monotonic()
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=120) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                return time.monotonic() - asked
    raise RuntimeError("the first answer had no content")


def _calibrated(server: ServerProcess, launched: float) -> float:
    if server.wait_calibrated(CALIBRATION_TIMEOUT_SECONDS, poll_seconds=0.2):
        return time.monotonic() - launched
    return -1.0


async def _decode_tpot(server: ServerProcess) -> tuple[float, int]:
    """The mean time per output token of :data:`STREAMS` streams at once, and how many
    of them were refused."""
    model = str(server.stats()["model"])
    async with httpx.AsyncClient(base_url=server.v1, timeout=300) as client:
        tpots = await asyncio.gather(*(_one_stream(client, model, i) for i in range(STREAMS)))
    served = [tpot for tpot in tpots if tpot is not None]
    return (sum(served) / len(served) if served else 0.0), len(tpots) - len(served)


async def _one_stream(client: httpx.AsyncClient, model: str, seed: int) -> float | None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me a story, number {seed}."}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = 0.0
    tokens = 0
    async with client.stream("POST", "/chat/completions", json=body) as reply:
        if reply.status_code == 429:
            return None
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = time.monotonic()
                first = first or last
    if tokens < 2 or not first:
        raise RuntimeError("a decode stream produced fewer than two tokens")
    return (last - first) / (tokens - 1)
