"""When upstreams fail or push back, and when a reader is slow: a killed upstream's
stream continues on another with nothing lost or repeated, a paused reader's upstream
request is let go and continued, and upstreams that hang or answer 429 are left for
others.  The upstreams are sim servers, whose tokens are bytes: with the byte tokenizer
the gateway counts exactly what they produce."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.support.servers import ServerProcess
from tests.upstream.conftest import start_gateway, start_upstream, upstream_cancelled

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
BYTES = ["--upstream-tokenizer", "bytes"]


def port_of(server: ServerProcess) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def holder(gateway: ServerProcess) -> str | None:
    """The upstream holding the gateway's one request."""
    upstreams = gateway.stats()["upstreams"]
    busy = [name for name, u in upstreams.items() if u["outstanding_requests"]]
    return busy[0] if len(busy) == 1 else None


def test_a_killed_upstream_is_replaced_mid_stream() -> None:
    first, second = start_upstream("fail-1"), start_upstream("fail-2")
    gateway = start_gateway([first, second], "failover", *BYTES)
    try:
        by_name = {u.base_url.split("://")[1]: u for u in (first, second)}
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell a story"}],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        stream = open_stream("127.0.0.1", port_of(gateway), "/v1/chat/completions", body)
        events = stream.events()
        text = []
        for event in events:
            if (piece := event_text(event)) is not None:
                text.append(piece)
            if len("".join(text).encode()) > 50:
                break
        name = wait_for(lambda: holder(gateway), 5, "the request to be held")
        by_name[name].process.kill()  # mid-answer, without a goodbye
        by_name[name].process.wait()
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
        assert 297 <= len("".join(text).encode()) <= 300
        stats = gateway.stats()["upstreams"]
        assert stats[name]["failovers_total"] == 1
        assert stats[name]["failures_total"] >= 1
    finally:
        gateway.stop()
        first.stop()
        second.stop()


def test_a_paused_reader_lets_go_of_its_upstream_and_continues(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    upstream = start_upstream("pause")
    config = tmp_path_factory.mktemp("pause") / "gateway.yaml"
    config.write_text(f"upstreams:\n  - url: {upstream.base_url}\n    max_concurrent: 1\n")
    gateway = start_gateway(
        [],
        "pause",
        "--config",
        str(config),
        *BYTES,
        "--pause-preempt-seconds",
        "0.5",
        "--high-water-tokens",
        "32",
        "--low-water-tokens",
        "8",
        "--flush-interval-ms",
        "0",
        "--socket-send-buffer-bytes",
        "4096",
        "--transport-write-buffer-bytes",
        "4096",
        "--stall-timeout-seconds",
        "60",
    )
    try:
        cancelled = upstream_cancelled(upstream)
        # Long enough not to fit in the socket buffers between the upstream and the gateway.
        body = {
            "model": MODEL,
            "prompt": "a long answer",
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
        }
        slow = open_stream(
            "127.0.0.1", port_of(gateway), "/v1/completions", body, receive_buffer_bytes=4096
        )
        events = slow.events(max_read_bytes=256)
        first = [event_text(next(events)) for _ in range(3)]
        wait_for(lambda: gateway.stats()["requests_paused"] == 1, 10, "the reader to pause")
        # Another request needs the upstream's only place: the paused one lets it go.
        other = httpx.post(
            gateway.v1 + "/completions",
            json={"model": MODEL, "prompt": "quick", "max_tokens": 20},
            timeout=30,
        )
        assert other.status_code == 200, other.text
        # The upstream's own count (it keeps a dropped stream for its 1 s detach grace).
        wait_for(lambda: upstream_cancelled(upstream) > cancelled, 5, "the upstream's abort")
        assert gateway.stats()["preemptions_total"] >= 1
        # The slow reader reads on: its answer continues (a continuation request) to the end.
        text = "".join(t or "" for t in first)
        finished = False
        for event in events:
            if event.data == b"data: [DONE]":
                finished = True
                break
            text += event_text(event) or ""
        slow.close()
        assert finished and 597 <= len(text.encode()) <= 600
    finally:
        gateway.stop()
        upstream.stop()


class HangingUpstream:
    """A real socket server that answers the model list but never answers a request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            while not self._stop.is_set():
                try:
                    head = conn.recv(65536)
                except OSError:
                    return
                if not head:
                    return
                if head.startswith(b"GET /v1/models"):
                    payload = orjson.dumps({"object": "list", "data": [{"id": MODEL}]})
                    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    conn.sendall(head + b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
                elif head.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                else:
                    self.requests += 1
                    self._stop.wait(30)  # never answers
                    return

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def hanging() -> Iterator[HangingUpstream]:
    server = HangingUpstream()
    yield server
    server.close()


def run_requests(gateway: ServerProcess, count: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"fault {i}", "max_tokens": 80, "ignore_eos": True}
        return httpx.post(gateway.v1 + "/completions", json=body, timeout=60)

    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda i=i: results.append(one(i))) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * count, [r.text for r in results]
    # Every answer whole (the sim's last character may be cut mid-UTF-8 and dropped).
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in results)
    assert all(r.json()["usage"]["completion_tokens"] >= 77 for r in results)
    return results


@pytest.fixture(scope="module")
def good() -> Iterator[ServerProcess]:
    server = start_upstream("good")
    yield server
    server.stop()


def test_a_hanging_upstream_is_left_for_another(
    hanging: HangingUpstream, good: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = tmp_path_factory.mktemp("hang") / "gateway.yaml"
    # The hanging one looks the least loaded (a large weight): it gets requests first.
    config.write_text(
        "upstreams:\n"
        f"  - {{url: {hanging.url}, name: hang, weight: 100}}\n"
        f"  - {{url: {good.base_url}, name: good}}\n"
    )
    gateway = start_gateway(
        [],
        "hang",
        "--config",
        str(config),
        *BYTES,
        "--upstream-first-token-timeout-seconds",
        "1",
        "--no-upstream-prefix-affinity",
    )
    try:
        run_requests(gateway, 4)
        upstreams = gateway.stats()["upstreams"]
        assert hanging.requests >= 1 and upstreams["hang"]["failures_total"] >= 1
    finally:
        gateway.stop()


def test_an_upstream_that_pushes_back_gets_less(
    good: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # It admits one request at a time and answers 429 to the rest (its metrics still say
    # it runs 16 at once, so only its answers tell the gateway).
    busy = start_upstream("busy", "--max-concurrent-requests", "1")
    config = tmp_path_factory.mktemp("busy") / "gateway.yaml"
    config.write_text(
        "upstreams:\n"
        f"  - {{url: {busy.base_url}, name: busy, weight: 100, max_concurrent: 8}}\n"
        f"  - {{url: {good.base_url}, name: good}}\n"
    )
    gateway = start_gateway(
        [], "busy", "--config", str(config), *BYTES, "--no-upstream-prefix-affinity"
    )
    try:
        run_requests(gateway, 8)  # none of its 429s reaches a client
        busy_stats = gateway.stats()["upstreams"]["busy"]
        assert busy_stats["pushbacks_total"] >= 1, busy_stats
        assert busy_stats["limit"] < 8, busy_stats
    finally:
        gateway.stop()
        busy.stop()


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


def kill_holder(gateway: ServerProcess, upstreams: list[ServerProcess]) -> ServerProcess:
    """Kill the upstream holding the gateway's one request, without a goodbye; the other."""
    by_name = {u.base_url.split("://")[1]: u for u in upstreams}
    name = wait_for(lambda: holder(gateway), 5, "the request to be held")
    by_name[name].process.kill()
    by_name[name].process.wait()
    return next(u for n, u in by_name.items() if n != name)


def test_a_tool_call_answer_cut_mid_call_restarts_and_skips() -> None:
    """Two calls; the upstream is killed once the client has the first (the second is
    under way, held at the gateway).  The request is asked again from the start on the
    other upstream (the sim answers a seed the same everywhere): the client gets the
    first call once and the second whole, as from an upstream that never failed."""
    # 30 ms steps, a byte a step: the second call takes over a second to generate.
    slow = ["--sim-step-base-ms", "30"]
    first, second = start_upstream("tools-1", *slow), start_upstream("tools-2", *slow)
    gateway = start_gateway([first, second], "tools", *BYTES)
    try:
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
        events = stream.events()
        for event in events:
            if b'"tool_calls"' in event.data:
                break  # the first call, whole
        survivor = kill_holder(gateway, [first, second])
        rest, errors = choices_of(events)
        stream.close()
        assert not errors, errors
        direct = httpx.post(survivor.v1 + "/chat/completions", json=body, timeout=60).json()
        expected = direct["choices"][0]["message"]["tool_calls"]
        assert len(expected) == 2
        # The second call, whole and once; the first was not sent again.
        calls = rest.get(0, {"calls": []})["calls"]
        assert [c["function"] for c in calls] == [expected[1]["function"]]
        assert calls[0]["index"] == 1
        assert rest[0]["finish"] == ["tool_calls"]
        assert failovers(gateway) == 1
    finally:
        gateway.stop()
        first.stop()
        second.stop()


def test_several_choices_cut_short_restart_and_skip() -> None:
    first, second = start_upstream("n-1"), start_upstream("n-2")
    gateway = start_gateway([first, second], "n", *BYTES)
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "two stories"}],
            "n": 2,
            "max_tokens": 200,
            "ignore_eos": True,
            "seed": 4,
        }
        stream = open_stream(
            "127.0.0.1", port_of(gateway), "/v1/chat/completions", {**body, "stream": True}
        )
        events = stream.events()
        before, _ = choices_of(events_until(events, 10))
        survivor = kill_holder(gateway, [first, second])
        after, errors = choices_of(events)
        stream.close()
        assert not errors, errors
        direct = httpx.post(survivor.v1 + "/chat/completions", json=body, timeout=60).json()
        for choice in direct["choices"]:
            i = choice["index"]
            text = before.get(i, {"text": ""})["text"] + after[i]["text"]
            assert text == choice["message"]["content"]  # nothing twice, nothing missing
            assert after[i]["finish"] == ["length"]
        assert failovers(gateway) == 1
    finally:
        gateway.stop()
        first.stop()
        second.stop()


def events_until(events: Iterator[Any], num_chunks: int) -> Iterator[Any]:
    """The first ``num_chunks`` content events of a stream (then stop reading)."""
    seen = 0
    for event in events:
        yield event
        if event.data.startswith(b"data: {") and b'"content"' in event.data:
            seen += 1
            if seen >= num_chunks:
                return


def failovers(gateway: ServerProcess) -> int:
    return sum(u["failovers_total"] for u in gateway.stats()["upstreams"].values())
