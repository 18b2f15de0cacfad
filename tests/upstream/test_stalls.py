"""When a reader or an upstream stalls: a paused reader's upstream request is let go
and continued, and upstreams that hang or answer 429 are left for others.  The upstreams
are sim servers (5 ms steps), and a socket that never answers; with the byte tokenizer
the gateways count exactly what the sims produce.  (Upstreams that die: test_failover.py.)

Each test has its gateway; all start together, in front of upstreams no test kills."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.support import plain_http
from tests.support.servers import ServerProcess, start_servers
from tests.upstream.conftest import GATEWAY, PAUSE, SLOW_SIM, upstream_cancelled
from tests.upstream.test_failover import BYTES, MODEL, port_of, wait_for

pytestmark = pytest.mark.slow


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


@dataclass
class Stalls:
    """The module's upstreams and gateways."""

    #: A sim upstream that takes what it is sent.
    good: ServerProcess
    #: One that admits one request at a time and answers 429 to the rest (its metrics
    #: still say it runs 16 at once, so only its answers tell the gateway).
    busy: ServerProcess
    hanging: HangingUpstream
    #: In front of ``good`` alone, one request at a time; a paused reader lets go of it
    #: after half a second.
    pause: ServerProcess
    #: In front of ``hanging`` (weight 100: it looks the least loaded and gets requests
    #: first), then ``good``; a second without a first token is a failure.
    hang: ServerProcess
    #: In front of ``busy`` (weight 100, 8 places), then ``good``.
    pushback: ServerProcess


@pytest.fixture(scope="module")
def stalls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalls]:
    hanging = HangingUpstream()
    started: list[ServerProcess] = []
    try:
        busy = ["--max-concurrent-requests", "1"]
        started += start_servers((SLOW_SIM, "upstream-good"), ([*SLOW_SIM, *busy], "upstream-busy"))
        good, busy_upstream = started
        tmp = tmp_path_factory.mktemp("stalls")
        pause = config(tmp / "pause.yaml", f"  - {{url: {good.base_url}, max_concurrent: 1}}")
        hang = config(
            tmp / "hang.yaml",
            f"  - {{url: {hanging.url}, name: hang, weight: 100}}",
            f"  - {{url: {good.base_url}, name: good}}",
        )
        pushback = config(
            tmp / "busy.yaml",
            f"  - {{url: {busy_upstream.base_url}, name: busy, weight: 100, max_concurrent: 8}}",
            f"  - {{url: {good.base_url}, name: good}}",
        )
        one_second = ["--upstream-first-token-timeout-seconds", "1"]
        started += start_servers(
            ([*GATEWAY, *pause, *BYTES, *PAUSE], "gateway-pause"),
            (
                [*GATEWAY, *hang, *BYTES, *one_second, "--no-upstream-prefix-affinity"],
                "gateway-hang",
            ),
            ([*GATEWAY, *pushback, *BYTES, "--no-upstream-prefix-affinity"], "gateway-busy"),
        )
        yield Stalls(good, busy_upstream, hanging, *started[2:])
    finally:
        for server in started:
            server.stop()
        hanging.close()


def config(path: Path, *upstreams: str) -> list[str]:
    """``--config`` of a file listing ``upstreams`` (YAML flow mappings)."""
    path.write_text("upstreams:\n" + "".join(line + "\n" for line in upstreams))
    return ["--config", str(path)]


def test_a_paused_reader_lets_go_of_its_upstream_and_continues(stalls: Stalls) -> None:
    upstream, gateway = stalls.good, stalls.pause
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
    wait_for(lambda: plain_http.stats(gateway)["requests_paused"] == 1, 10, "the reader to pause")
    # Another request needs the upstream's only place: the paused one lets it go.
    other = plain_http.post(
        gateway.v1 + "/completions",
        json={"model": MODEL, "prompt": "quick", "max_tokens": 20},
        timeout=30,
    )
    assert other.status_code == 200, other.text
    # The upstream's own count (it keeps a dropped stream for its 1 s detach grace).
    wait_for(lambda: upstream_cancelled(upstream) > cancelled, 5, "the upstream's abort")
    assert plain_http.stats(gateway)["preemptions_total"] >= 1
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


def run_requests(gateway: ServerProcess, count: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"fault {i}", "max_tokens": 80, "ignore_eos": True}
        return plain_http.post(gateway.v1 + "/completions", json=body, timeout=60)

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


def test_a_hanging_upstream_is_left_for_another(stalls: Stalls) -> None:
    run_requests(stalls.hang, 4)
    upstreams = plain_http.stats(stalls.hang)["upstreams"]
    assert stalls.hanging.requests >= 1 and upstreams["hang"]["failures_total"] >= 1


def test_an_upstream_that_pushes_back_gets_less(stalls: Stalls) -> None:
    run_requests(stalls.pushback, 8)  # none of its 429s reaches a client
    busy = plain_http.stats(stalls.pushback)["upstreams"]["busy"]
    assert busy["pushbacks_total"] >= 1, busy
    assert busy["limit"] < 8, busy
