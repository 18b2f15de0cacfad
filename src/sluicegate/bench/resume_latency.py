"""``sluicegate bench resume``: how long a client that lost a Responses stream waits
before its events flow again, resuming with ``starting_after`` (sim engine, two replicas
sharing one Redis started here from ``redis-server`` on the ``PATH``).

Each sample starts a background streamed response, reads ``EVENTS_BEFORE`` events and
drops the connection, then times from sending the resume request to its first event:

* **same replica**: the replica generating it attaches the new connection (the missed
  events come from the log);
* **other replica**: a second replica relays the log while the first still generates;
* **after a kill**: the generating replica is SIGKILLed (having generated unread for
  ``GENERATES_BEFORE_KILL_SECONDS``); the other replays the log at once (*first
  replayed event*), and continues the response once the dead replica's
  lease has expired (*first new event*: the first event the dead replica never logged,
  bounded below by ``--lease-ttl-seconds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args
from sluicegate.store.factory import open_store
from sluicegate.stream.log_reads import read_all
from sluicegate.stream.response_events import last_sequence_number

#: Events read before the connection is dropped.
EVENTS_BEFORE = 10
LEASE_TTL_SECONDS = 1.0
#: How long the doomed replica generates after the connection dropped.
GENERATES_BEFORE_KILL_SECONDS = 0.3
KEY = "bench-resume"
HEADERS = {"authorization": f"Bearer {KEY}"}
BODY = {
    "input": "Write a long story about a lighthouse keeper.",
    "max_output_tokens": 400,
    "stream": True,
    "background": True,
    "seed": 3,
}


@dataclass(slots=True)
class ResumeResult:
    """Seconds from a resume request to its first event, by case."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, case: str, seconds: float) -> None:
        self.samples.setdefault(case, []).append(seconds)

    def lines(self) -> list[str]:
        out = ["| case | samples | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
        for case, values in self.samples.items():
            ordered = sorted(values)
            p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
            out.append(
                f"| {case} | {len(values)} | {statistics.median(values) * 1000:.1f} | "
                f"{p99 * 1000:.1f} | {ordered[-1] * 1000:.1f} |"
            )
        return out


def _events(lines: Iterator[str]) -> Iterator[dict[str, object]]:
    for line in lines:
        if line.startswith("data: {"):
            yield orjson.loads(line[6:])


def _start(client: httpx.Client, server: ServerProcess) -> str:
    """A background streamed response, read for ``EVENTS_BEFORE`` events; its id."""
    with client.stream("POST", server.v1 + "/responses", json=BODY, headers=HEADERS) as reply:
        reply.raise_for_status()
        response_id = ""
        for count, event in enumerate(_events(reply.iter_lines()), start=1):
            if event["type"] == "response.created":
                response_id = str(event["response"]["id"])  # type: ignore[index]
            if count == EVENTS_BEFORE:
                return response_id
    raise RuntimeError("the response ended before the connection was dropped")


def _resume(
    client: httpx.Client, server: ServerProcess, response_id: str, new_from: int | None = None
) -> tuple[float, float | None]:
    """Seconds to the first event of a resume, and (``new_from``) to the first event
    numbered at least ``new_from``."""
    url = f"{server.v1}/responses/{response_id}"
    params = {"stream": "true", "starting_after": str(EVENTS_BEFORE - 1)}
    started = time.perf_counter()
    first: float | None = None
    with client.stream("GET", url, params=params, headers=HEADERS) as reply:
        reply.raise_for_status()
        for event in _events(reply.iter_lines()):
            now = time.perf_counter() - started
            if first is None:
                first = now
                if new_from is None:
                    return first, None
            number = event["sequence_number"]
            if new_from is not None and isinstance(number, int) and number >= new_from:
                return first, now
    raise RuntimeError(f"the resumed response {response_id} ended without the events asked for")


@contextlib.contextmanager
def redis_for_bench(workdir: Path, given: str | None) -> Iterator[str]:
    """``given``, or a Redis of the bench's own from ``redis-server`` on the PATH."""
    if given is not None:
        yield given
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not on the PATH (apt-get install -y redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


def resume_latency(
    out: Path, samples: int = 50, kills: int = 10, redis_url: str | None = None
) -> ResumeResult:
    """Run the cases of the module's docstring; server logs go under ``out``.
    ``redis_url``: a Redis to use (else one is started from ``redis-server``)."""
    out.mkdir(parents=True, exist_ok=True)
    result = ResumeResult()
    with tempfile.TemporaryDirectory() as tmp, redis_for_bench(Path(tmp), redis_url) as redis_url:
        config = Path(tmp) / "tenants.yaml"
        config.write_text(f"tenants:\n  - {{name: bench, api_key: {KEY}}}\n")
        args = [
            "--engine",
            "sim",
            "--sim-step-base-ms",
            "5",
            "--store",
            redis_url,
            "--config",
            str(config),
            "--flush-interval-ms",
            "0",
            "--lease-ttl-seconds",
            str(LEASE_TTL_SECONDS),
            "--admission",
            "static",
        ]
        a = start_server_with_args(args, out / "replica-a.log")
        b = start_server_with_args(args, out / "replica-b.log")
        try:
            with httpx.Client(timeout=60) as client:
                for _ in range(samples):
                    result.add("same replica", _resume(client, a, _start(client, a))[0])
                for _ in range(samples):
                    result.add("other replica", _resume(client, b, _start(client, a))[0])
                for index in range(kills):
                    doomed = start_server_with_args(args, out / f"doomed-{index}.log")
                    response_id = _start(client, doomed)
                    # It goes on logging for a while unread: there is something to replay.
                    time.sleep(GENERATES_BEFORE_KILL_SECONDS)
                    doomed.process.send_signal(signal.SIGKILL)
                    doomed.process.wait(10)
                    new_from = asyncio.run(_logged_events(redis_url, response_id))
                    first, new = _resume(client, b, response_id, new_from)
                    result.add("after a kill: first replayed event", first)
                    assert new is not None
                    result.add("after a kill: first new event", new)
        finally:
            a.stop()
            b.stop()
    (out / "resume.md").write_text("\n".join(result.lines()) + "\n")
    return result


async def _logged_events(redis_url: str, response_id: str) -> int:
    """How many events the response's log holds (what the dead replica logged)."""
    async with open_store(redis_url) as store:
        entries = await read_all(store, response_id)
    numbers = [n for n in map(last_sequence_number, entries) if n is not None]
    return numbers[-1] + 1 if numbers else 0
