"""Connection floods against a server limited to 1,024 open files: 1,100 sockets that send
nothing, then 1,100 that drip their headers.  ``/health`` keeps answering fast throughout,
and the server never runs out of file descriptors."""

from __future__ import annotations

import resource
import selectors
import socket
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.conftest import FAST_SIM, assert_healthy
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

FILE_LIMIT = 1024
FLOOD = 1100


def lower_file_limit() -> None:
    """Runs in the server's process before it starts."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * FLOOD + 100  # this process's sockets
    if hard < needed:
        pytest.skip(f"the open-file hard limit ({hard}) is below the {needed} the flood needs")
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    journal = tmp_path_factory.mktemp("floods") / "jobs.sqlite3"
    server = start_server(
        [*FAST_SIM, "--journal-path", str(journal)], "floods", preexec_fn=lower_file_limit
    )
    yield server
    server.stop()


def connect_many(server: ServerProcess, count: int) -> list[socket.socket]:
    host, port = server.base_url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((host, int(port)))
        sockets.append(sock)
    return sockets


def health_latencies(server: ServerProcess, seconds: float) -> list[float]:
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        response = httpx.get(server.base_url + "/health", timeout=5)
        assert response.status_code == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.05)
    return latencies


def open_files(server: ServerProcess) -> float:
    return server.metrics().total("process_open_fds")


def test_silent_connections_cannot_take_health_down(limited_server: ServerProcess) -> None:
    flood = connect_many(limited_server, FLOOD)
    try:
        time.sleep(1.0)  # accepted (and the oldest closed to make room)
        latencies = health_latencies(limited_server, 2.0)
        assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0, latencies
        assert open_files(limited_server) < FILE_LIMIT
    finally:
        for sock in flood:
            sock.close()
    assert_healthy(limited_server)


def test_dripped_headers_cannot_take_health_down(limited_server: ServerProcess) -> None:
    flood = connect_many(limited_server, FLOOD)
    selector = selectors.DefaultSelector()
    try:
        time.sleep(0.5)
        for sock in flood:
            selector.register(sock, selectors.EVENT_WRITE)
        # Each socket sends its request line, then one header byte at a time.
        sent = dict.fromkeys(flood, 0)
        started = time.monotonic()
        latencies: list[float] = []
        while time.monotonic() - started < 3.0:
            for key, _ in selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                part = b"GET / HTTP/1.1\r\nX-Slow: " if sent[sock] == 0 else b"a"
                try:
                    sock.send(part)
                    sent[sock] += 1
                except OSError:
                    selector.unregister(sock)  # closed by the server: fine
            latencies += health_latencies(limited_server, 0.2)
        assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0, latencies
        assert open_files(limited_server) < FILE_LIMIT
    finally:
        selector.close()
        for sock in flood:
            sock.close()
    assert_healthy(limited_server)
