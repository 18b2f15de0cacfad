"""When an upstream dies mid-answer: its stream continues on another with nothing lost
or repeated, a text continued, tool calls and several choices asked again from the start
and skipped where the client has them.  The upstreams are sim servers, whose tokens are
bytes: with the byte tokenizer the gateway counts exactly what they produce.  (Upstreams
that hang or push back, and readers that stall: test_stalls.py.)

The tests share one gateway in front of :data:`NUM_KILLABLE` sim upstreams
(:func:`killable`): each kills the one holding its request, and the next fails over
among those left.  Each finds that upstream before it reads the answer, so the kill
follows the text it waits for at once, with most of the answer still to generate."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.support import plain_http
from tests.support.background import in_background
from tests.support.servers import ServerProcess, start_servers
from tests.upstream.conftest import SLOW_SIM, start_gateway

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
BYTES = ["--upstream-tokenizer", "bytes"]
#: Upstreams behind the killing tests' gateway: each of the three kills one, and needs
#: one left to fail over to.
NUM_KILLABLE = 4
#: 10 ms steps, a byte a step: what a test reads before its kill is a few tenths of a
#: second of the answer, what is left to generate after it more than a second.
KILLABLE_STEP = ["--sim-step-base-ms", "10"]


def port_of(server: ServerProcess) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Killable:
    """A gateway in front of upstreams that tests kill one at a time."""

    gateway: ServerProcess
    upstreams: list[ServerProcess]

    def held(self) -> tuple[str, ServerProcess, ServerProcess]:
        """The upstream holding the gateway's one request (the gateway's name for it,
        host:port, and itself), and another live one, which survives its kill."""
        live = {u.base_url.split("://")[1]: u for u in self.upstreams if u.process.poll() is None}
        assert len(live) >= 2, "no upstream left to fail over to"

        def holder() -> str | None:
            upstreams = plain_http.stats(self.gateway)["upstreams"]
            busy = [name for name, u in upstreams.items() if u["outstanding_requests"]]
            return busy[0] if len(busy) == 1 else None

        name = wait_for(holder, 10, "the request to be held")
        return name, live[name], next(u for n, u in live.items() if n != name)

    def failovers(self) -> int:
        upstreams = plain_http.stats(self.gateway)["upstreams"].values()
        return sum(u["failovers_total"] for u in upstreams)


@pytest.fixture(scope="module")
def killable() -> Iterator[Killable]:
    upstreams = start_servers(
        *(([*SLOW_SIM, *KILLABLE_STEP], f"upstream-kill-{i}") for i in range(NUM_KILLABLE))
    )
    try:
        gateway = start_gateway(upstreams, "failover", *BYTES)
        yield Killable(gateway, upstreams)
        gateway.stop()
    finally:
        for upstream in upstreams:
            upstream.stop()


def kill(upstream: ServerProcess) -> None:
    """Mid-answer, without a goodbye."""
    upstream.process.kill()
    upstream.process.wait()


def asked_directly(upstream: ServerProcess, body: dict[str, Any]) -> Future[dict[str, Any]]:
    """The answer ``upstream`` gives ``body`` itself, asked in the background."""

    def ask() -> dict[str, Any]:
        response = plain_http.post(upstream.v1 + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    return in_background(ask)


def test_a_killed_upstream_is_replaced_mid_stream(killable: Killable) -> None:
    gateway = killable.gateway
    n = 150
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell a story"}],
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
    }
    stream = open_stream("127.0.0.1", port_of(gateway), "/v1/chat/completions", body)
    name, held, _ = killable.held()
    events = stream.events()
    text = []
    for event in events:
        if (piece := event_text(event)) is not None:
            text.append(piece)
        if len("".join(text).encode()) > 20:
            break
    kill(held)
    finish, done = None, False
    for event in events:
        if event.data == b"data: [DONE]":
            done = True
            break
        assert b'"error"' not in event.data, event.data
        payload = orjson.loads(event.data[6:]) if event.data.startswith(b"data: {") else {}
        finish = (payload.get("choices") or [{}])[0].get("finish_reason") or finish
        if (piece := event_text(event)) is not None:
            text.append(piece)
    stream.close()
    assert done and finish == "length"
    # One stream of max_tokens tokens (bytes): nothing twice, none missing (less a
    # last character the sim may cut mid-UTF-8 and drop).
    assert n - 3 <= len("".join(text).encode()) <= n
    stats = plain_http.stats(gateway)["upstreams"]
    assert stats[name]["failovers_total"] == 1
    assert stats[name]["failures_total"] >= 1


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "country": {"type": "string"},
                    "days": {"type": "integer"},
                },
                "required": ["city", "country", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}, "format": {"type": "string"}},
                "required": ["zone", "format"],
            },
        },
    },
]


def choices_of(events: Iterator[Any]) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Each choice's text, tool-call deltas and finishes as the client got them, and any
    error events, reading ``events`` to the end of the stream."""
    got: dict[int, dict[str, Any]] = {}
    errors: list[dict[str, Any]] = []
    for event in events:
        if event.data == b"data: [DONE]":
            break
        if not event.data.startswith(b"data: {"):
            continue
        payload = orjson.loads(event.data[6:])
        if "error" in payload:
            errors.append(payload["error"])
        for choice in payload.get("choices") or []:
            into = got.setdefault(choice["index"], {"text": "", "calls": [], "finish": []})
            into["text"] += choice["delta"].get("content") or ""
            into["calls"] += choice["delta"].get("tool_calls") or []
            if choice["finish_reason"]:
                into["finish"].append(choice["finish_reason"])
    return got, errors


def test_a_tool_call_answer_cut_mid_call_restarts_and_skips(killable: Killable) -> None:
    """Two calls; the upstream is killed once the client has the first (the second is
    under way, held at the gateway: at 10 ms a step it takes over a second to generate).
    The request is asked again from the start on another upstream (the sim answers a
    seed the same everywhere): the client gets the first call once and the second whole,
    as from an upstream that never failed."""
    gateway = killable.gateway
    failovers = killable.failovers()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather and time in Paris?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 12,
    }
    stream = open_stream(
        "127.0.0.1", port_of(gateway), "/v1/chat/completions", {**body, "stream": True}
    )
    _, held, survivor = killable.held()
    direct = asked_directly(survivor, body)  # meanwhile, from an upstream that lives on
    events = stream.events()
    for event in events:
        if b'"tool_calls"' in event.data:
            break  # the first call, whole
    kill(held)
    rest, errors = choices_of(events)
    stream.close()
    assert not errors, errors
    expected = direct.result(60)["choices"][0]["message"]["tool_calls"]
    assert len(expected) == 2
    # The second call, whole and once; the first was not sent again.
    calls = rest.get(0, {"calls": []})["calls"]
    assert [c["function"] for c in calls] == [expected[1]["function"]]
    assert calls[0]["index"] == 1
    assert rest[0]["finish"] == ["tool_calls"]
    assert killable.failovers() - failovers == 1


def test_several_choices_cut_short_restart_and_skip(killable: Killable) -> None:
    gateway = killable.gateway
    failovers = killable.failovers()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "two stories"}],
        "n": 2,
        "max_tokens": 120,
        "ignore_eos": True,
        "seed": 4,
    }
    stream = open_stream(
        "127.0.0.1", port_of(gateway), "/v1/chat/completions", {**body, "stream": True}
    )
    _, held, survivor = killable.held()
    direct = asked_directly(survivor, body)
    events = stream.events()
    before, _ = choices_of(events_until(events, 10))
    kill(held)
    after, errors = choices_of(events)
    stream.close()
    assert not errors, errors
    for choice in direct.result(60)["choices"]:
        i = choice["index"]
        text = before.get(i, {"text": ""})["text"] + after[i]["text"]
        assert text == choice["message"]["content"]  # nothing twice, nothing missing
        assert after[i]["finish"] == ["length"]
    assert killable.failovers() - failovers == 1


def events_until(events: Iterator[Any], num_chunks: int) -> Iterator[Any]:
    """The first ``num_chunks`` content events of a stream (then stop reading)."""
    seen = 0
    for event in events:
        yield event
        if event.data.startswith(b"data: {") and b'"content"' in event.data:
            seen += 1
            if seen >= num_chunks:
                return
