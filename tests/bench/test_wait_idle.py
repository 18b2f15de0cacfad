"""The capacity search waits for a plain engine to finish what a trial left it: by the
engine's own gauges (llama-server's, vLLM's, Sluicegate's), over a real socket."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sluicegate.bench.scrape import wait_until_idle


class Engine:
    """``/metrics`` of an engine that holds ``busy_scrapes`` scrapes' worth of work."""

    def __init__(self, busy_scrapes: int, gauge: str) -> None:
        self.left = busy_scrapes
        self.gauge = gauge
        self.scrapes = 0


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, str]]:
    state = Engine(*request.param)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.scrapes += 1
            busy = 1 if state.left > 0 else 0
            state.left -= 1
            body = f"# TYPE {state.gauge} gauge\n{state.gauge} {busy}\n".encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "engine",
    [(3, "llamacpp:requests_processing"), (2, "vllm:num_requests_waiting")],
    indirect=True,
)
def test_it_waits_until_the_engine_holds_nothing(engine: tuple[Engine, str]) -> None:
    state, url = engine
    assert wait_until_idle(url, timeout_seconds=30.0)
    assert state.left < 0 and state.scrapes >= 3  # it polled through the busy scrapes


@pytest.mark.parametrize("engine", [(10_000, "sluicegate_requests_running")], indirect=True)
def test_it_gives_up_at_its_timeout(engine: tuple[Engine, str]) -> None:
    _, url = engine
    assert not wait_until_idle(url, timeout_seconds=0.5)


def test_a_server_without_metrics_counts_as_idle() -> None:
    assert wait_until_idle("http://127.0.0.1:9", timeout_seconds=5.0)  # nothing listens
