"""``bench engine-peer``'s side figure: the peer's own decode rate, read from the
``timings`` llama-server puts in its answers.  A small HTTP server on a free local port
plays the peer (CI never builds llama-server): it drops the first connection without an
answer, as one llama-server did after the 32-stream phase, then answers with timings."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from sluicegate.bench import peer_engine
from sluicegate.bench.peer_engine import PeerRun, Point, _own_decode_rate, table


class _Peer(BaseHTTPRequestHandler):
    rates = (120.0, 140.0, 130.0)
    timings = True
    requests = 0

    def do_POST(self) -> None:
        cls = type(self)
        cls.requests += 1
        self.rfile.read(int(self.headers["content-length"]))
        if cls.requests == 1:
            self.close_connection = True
            return  # no answer at all: the client sees the connection dropped
        body: dict[str, object] = {"choices": [{"message": {"content": "x"}}]}
        if cls.timings:
            body["timings"] = {"predicted_per_second": cls.rates[(cls.requests - 2) % 3]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def peer(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # After a dropped answer the bench waits a second before asking again (a real peer
    # may be busy); this one answers at once, so the wait is left out.
    real_sleep = asyncio.sleep

    async def no_wait(seconds: float) -> None:
        await real_sleep(0)

    shim = SimpleNamespace(**{**vars(asyncio), "sleep": no_wait})
    monkeypatch.setattr(peer_engine, "asyncio", shim)
    _Peer.requests = 0
    _Peer.timings = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    # Polled every 50 ms (not the default 0.5 s), so that shutting it down is quick.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_peers_own_rate_is_the_median_of_its_timings_despite_a_dropped_answer(
    peer: str,
) -> None:
    assert asyncio.run(_own_decode_rate(peer, 8)) == 130.0
    assert _Peer.requests == 4  # the dropped one, asked again, then three


def test_a_server_without_timings_has_no_own_rate(peer: str) -> None:
    _Peer.timings = False
    assert asyncio.run(_own_decode_rate(peer, 8)) == 0.0


def test_the_table_compares_ours_with_the_peers_own_rate() -> None:
    def run(label: str, rate: float, own: float = 0.0) -> PeerRun:
        return PeerRun(label, [Point(1, rate, 0.05, 3, 0)], prompt_rate=300.0, own_decode_rate=own)

    lines = table([run("eager", 30.0), run("compiled", 52.0), run("llama-server", 100.0, 130.0)])
    own = [line for line in lines if "own one-stream decode rate" in line]
    assert own and "130 tokens/s" in own[0] and "0.40x" in own[0]
    lines = table([run("eager", 30.0), run("compiled", 52.0), run("llama-server", 100.0)])
    assert not [line for line in lines if "own one-stream" in line]
