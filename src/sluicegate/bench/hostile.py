"""``sluicegate bench hostile``: what a broken or hostile upstream costs the gateway.

A raw-socket upstream (served here, on a thread of this process) answers every chat
completion in one of these ways, one scenario at a time:

* ``ignores-max-tokens``: 2,000 events of text, whatever ``max_tokens`` says;
* ``one-10mb-event``: a single SSE event of 10 MB;
* ``1mb-events``: 1 MB events, one after another, until the scenario ends;
* ``drip``: a valid event one byte a second;
* ``garbage``: random bytes, then the connection closes.

A gateway (``sluicegate serve --engine upstream``, its own process) stands in front. For
each scenario ``CLIENTS`` streamed requests of ``max_tokens: 50`` are sent at once while
``/health`` is timed every 20 ms and the gateway's resident memory is read from its
``/metrics`` every 200 ms. Reported per scenario: the answers (status, finish, tokens at
most ``max_tokens``), ``/health`` p50/p99 and the gateway's RSS growth over its level
before the scenario.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from sluicegate.bench.scrape import parse_metrics
from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args

SCENARIOS = ("ignores-max-tokens", "one-10mb-event", "1mb-events", "drip", "garbage")
MODEL = "hostile"
CLIENTS = 4
MAX_TOKENS = 50
#: How long a scenario's upstream goes on at most (1 MB events, the drip).
SCENARIO_SECONDS = 6.0
HEALTH_INTERVAL_SECONDS = 0.02
RSS_INTERVAL_SECONDS = 0.2


def _event(content: str) -> bytes:
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class HostileUpstream:
    """An OpenAI-shaped upstream that misbehaves as :attr:`scenario` says, in a process
    of its own (its 10 MB writes must not slow the measuring process)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._scenario = context.Value("i", 0)
        self.port = free_port()
        self._process = context.Process(
            target=_serve_forever, args=(self.port, self._scenario), daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def scenario(self) -> str:
        return SCENARIOS[self._scenario.value]

    @scenario.setter
    def scenario(self, name: str) -> None:
        self._scenario.value = SCENARIOS.index(name)

    def start(self) -> HostileUpstream:
        self._process.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the hostile upstream did not start")

    def stop(self) -> None:
        self._process.terminate()
        self._process.join(10)


def _serve_forever(port: int, scenario: Any) -> None:
    upstream = _Upstream(scenario)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.start_server(upstream.serve, "127.0.0.1", port))
    loop.run_forever()


class _Upstream:
    def __init__(self, scenario: Any) -> None:
        self._scenario = scenario

    @property
    def scenario(self) -> str:
        return SCENARIOS[self._scenario.value]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            headers = dict(h.partition(": ")[::2] for h in lines[1:] if h)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            if length:
                await reader.readexactly(length)
            if method == "GET":
                model = {"id": MODEL, "object": "model", "max_model_len": 4096}
                listing = {"object": "list", "data": [model]}
                body = orjson.dumps(listing if path.startswith("/v1/models") else {"ok": True})
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\nconnection: close\r\n\r\n"
                    + body
                )
            else:
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"connection: close\r\n\r\n"
                )
                await self._answer(writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> None:
        scenario = self.scenario
        deadline = time.monotonic() + SCENARIO_SECONDS
        if scenario == "ignores-max-tokens":
            for _ in range(2000):
                writer.write(_event("w "))
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
        elif scenario == "one-10mb-event":
            writer.write(_event("x" * (10 << 20)))
        elif scenario == "1mb-events":
            while time.monotonic() < deadline:
                writer.write(_event("y" * (1 << 20)))
                await writer.drain()
        elif scenario == "drip":
            for byte in _event("drip"):
                if time.monotonic() >= deadline:
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
        else:
            writer.write(os.urandom(64 << 10))


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    answers: list[str] = field(default_factory=list)
    within_max_tokens: bool = True
    health_seconds: list[float] = field(default_factory=list)
    rss_before: float = 0.0
    rss_peak: float = 0.0
    #: The most upstream text events relayed in one answer, and its ``usage.completion_tokens``.
    max_events: int = 0
    max_tokens_seen: int = 0

    def line(self) -> str:
        ordered = sorted(self.health_seconds)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        growth = (self.rss_peak - self.rss_before) / 2**20
        answers = ", ".join(f"{a} ×{self.answers.count(a)}" for a in sorted(set(self.answers)))
        return (
            f"| {self.scenario} | {answers} | "
            f"{'yes' if self.within_max_tokens else 'NO'} ({self.max_events}) | "
            f"{statistics.median(ordered) * 1000:.1f} | {p99 * 1000:.1f} | {growth:+.1f} |"
        )


HEADER = [
    "| upstream | client answers | within max_tokens (most events relayed) | /health p50 ms | "
    "/health p99 ms | "
    "gateway RSS growth MiB |",
    "|---|---|---|---|---|---|",
]


async def _client(
    http: httpx.AsyncClient, gateway: ServerProcess, result: ScenarioResult, seconds: float
) -> None:
    """Requests one after another while the scenario lasts."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await _request(http, gateway, result)


async def _request(http: httpx.AsyncClient, gateway: ServerProcess, result: ScenarioResult) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish, tokens, relayed = "none", 0, 0
    try:
        async with http.stream("POST", gateway.v1 + "/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                result.answers.append(f"HTTP {reply.status_code}")
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    finish = f"error {chunk['error'].get('code')}"
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    # Each of the upstream's text events is "w ": how many were relayed.
                    relayed += str((choice.get("delta") or {}).get("content") or "").count("w ")
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as error:
        finish = f"{type(error).__name__}"
    result.answers.append(finish)
    result.max_events = max(result.max_events, relayed)
    result.max_tokens_seen = max(result.max_tokens_seen, tokens)
    if relayed > MAX_TOKENS + 1:
        # The gateway bounds what it sees of an upstream's tokens: events with text (an
        # honest upstream sends at most one a token, and one that finishes).
        result.within_max_tokens = False


async def _watch(gateway: ServerProcess, result: ScenarioResult, done: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        next_rss = 0.0
        while not done.is_set():
            started = time.perf_counter()
            await http.get(gateway.base_url + "/health")
            result.health_seconds.append(time.perf_counter() - started)
            if time.monotonic() >= next_rss:
                next_rss = time.monotonic() + RSS_INTERVAL_SECONDS
                rss = _rss(await http.get(gateway.base_url + "/metrics"))
                result.rss_peak = max(result.rss_peak, rss)
            await asyncio.sleep(HEALTH_INTERVAL_SECONDS)


def _rss(reply: httpx.Response) -> float:
    return parse_metrics(reply.text).get("process_resident_memory_bytes") or 0.0


async def _scenario(gateway: ServerProcess, scenario: str, seconds: float) -> ScenarioResult:
    result = ScenarioResult(scenario)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=30)) as http:
        result.rss_before = result.rss_peak = _rss(await http.get(gateway.base_url + "/metrics"))
        done = asyncio.Event()
        watcher = asyncio.create_task(_watch(gateway, result, done))
        await asyncio.gather(*(_client(http, gateway, result, seconds) for _ in range(CLIENTS)))
        done.set()
        await watcher
    return result


def hostile_upstreams(
    out: Path, seconds: float = SCENARIO_SECONDS, eject_failures: int = 1_000_000
) -> list[ScenarioResult]:
    """Every scenario against one gateway, each for about ``seconds``; its log goes
    under ``out``.  ``eject_failures``: the gateway's ``--upstream-eject-failures`` (by
    default never: every request meets the hostile upstream; the server's own default, 3,
    ejects it after a few failures and spares the gateway most of what it sends)."""
    out.mkdir(parents=True, exist_ok=True)
    upstream = HostileUpstream().start()
    args = [
        "--engine",
        "upstream",
        "--upstream",
        upstream.url,
        "--upstream-tokenizer",
        "bytes",
        "--admission",
        "static",
        "--upstream-idle-timeout-seconds",
        "3",
        "--upstream-eject-failures",
        str(eject_failures),
    ]
    gateway = start_server_with_args(args, out / "gateway.log")
    results = []
    try:
        for scenario in SCENARIOS:
            upstream.scenario = scenario
            results.append(asyncio.run(_scenario(gateway, scenario, seconds)))
    finally:
        gateway.stop()
        upstream.stop()
    (out / "hostile.md").write_text("\n".join(HEADER + [r.line() for r in results]) + "\n")
    return results
