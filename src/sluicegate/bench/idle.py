"""``sluicegate bench idle``: is the first request after a quiet spell as fast as a warm
one?  (issue #35's keep-warm; docs/stall-free.md)

One embedded server (its warm-up done): ``warm`` short chat answers one after the other,
each read to its end (its time to first token kept), then ``idle_seconds`` with nothing
sent, then one answer (the first after the quiet spell) and ``after`` more.  Each
question is new (no prefix-cache hit), each answer is read whole (a client that leaves
early makes the server cancel, which the next request would wait on).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from sluicegate.bench.long_prompts import _WORDS
from sluicegate.bench.server_process import ServerProcess, start_server_with_args


@dataclass(slots=True)
class IdleRun:
    idle_seconds: float
    warm_ttft: list[float]
    first_ttft: float
    after_ttft: list[float]

    @property
    def ratio(self) -> float:
        """The first answer's TTFT after the quiet spell over the warm median."""
        return self.first_ttft / statistics.median(self.warm_ttft)

    def line(self) -> str:
        warm = statistics.median(self.warm_ttft) * 1000
        after = ", ".join(f"{t * 1000:.0f}" for t in self.after_ttft)
        return (
            f"warm TTFT median {warm:.0f} ms (of {len(self.warm_ttft)}); after "
            f"{self.idle_seconds:.0f} s idle: first {self.first_ttft * 1000:.0f} ms "
            f"({self.ratio:.2f}x), then {after} ms"
        )


def ttft(client: httpx.Client, question: str) -> float:
    """A short greedy answer, read to its end: its time to first token."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0.0,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"the server answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    first = time.monotonic() - started
    if first is None:
        raise RuntimeError("the answer had no text")
    return first


def measure(server: ServerProcess, idle_seconds: float, warm: int, after: int) -> IdleRun:
    questions = iter(
        f"In one line: what is a {a} {b}?" for a in _WORDS for b in reversed(_WORDS) if a != b
    )
    with httpx.Client(base_url=server.base_url, timeout=120.0) as client:
        warm_ttft = [ttft(client, next(questions)) for _ in range(warm)]
        time.sleep(idle_seconds)
        first = ttft(client, next(questions))
        after_ttft = [ttft(client, next(questions)) for _ in range(after)]
    return IdleRun(idle_seconds, warm_ttft, first, after_ttft)


def run(out: Path, idle_seconds: float, warm: int = 8, after: int = 4) -> IdleRun:
    """A server of its own, its warm-up waited for, then :func:`measure`."""
    out.mkdir(parents=True, exist_ok=True)
    server = start_server_with_args([], out / "server.log")
    try:
        server.wait_calibrated()
        return measure(server, idle_seconds, warm, after)
    finally:
        server.stop()
