"""Connection floods against a server limited to 1,024 open files: 1,100 sockets that send
nothing, then 1,100 that drip their headers.  ``/health`` keeps answering throughout, and
the server never runs out of file descriptors."""

from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from sluicegate.connections import default_max_connections
from tests.reliability.conftest import FAST_SIM, HEALTH_TIMEOUT_SECONDS, assert_healthy
from tests.support.servers import ServerProcess, start_server

# Its tests share a server: under pytest-xdist (make test) they run on one worker, which
# starts it once.
pytestmark = pytest.mark.slow

FILE_LIMIT = 1024
FLOOD = 1100
#: Health checks made while a flood is on.
HEALTH_CHECKS = 10
#: Only a server that never gets through the flood takes this long.
SETTLE_TIMEOUT_SECONDS = 60.0


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


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (without waiting: it is non-blocking)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except OSError:
        return True  # reset, or refused


def flood_accepted(server: ServerProcess, flood: list[socket.socket]) -> None:
    """Wait until the server has taken the whole flood in: past its connection cap it
    closes the oldest idle connection for each newcomer, so at least ``len(flood) - cap``
    of the flood are closed once it has accepted them all (without a cap, file
    descriptors would run out first)."""
    cap = default_max_connections(FILE_LIMIT)
    deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
    closed: set[socket.socket] = set()
    while len(closed) < len(flood) - cap:
        assert time.monotonic() < deadline, f"only {len(closed)} of the flood were closed"
        closed |= {sock for sock in flood if sock not in closed and closed_by_server(sock)}
        time.sleep(0.05)


def health_is_answered(server: ServerProcess) -> None:
    """``/health`` answers 200 while the flood is on.  Its speed is not asserted (the
    machine's, not the server's); a server out of file descriptors does not answer at
    all, and the open-file count below shows it never came close."""
    response = httpx.get(server.base_url + "/health", timeout=HEALTH_TIMEOUT_SECONDS)
    assert response.status_code == 200


def open_files(server: ServerProcess) -> float:
    return server.metrics().total("process_open_fds")


def test_silent_connections_cannot_take_health_down(limited_server: ServerProcess) -> None:
    flood = connect_many(limited_server, FLOOD)
    try:
        flood_accepted(limited_server, flood)
        for _ in range(HEALTH_CHECKS):
            health_is_answered(limited_server)
        assert open_files(limited_server) < FILE_LIMIT
    finally:
        for sock in flood:
            sock.close()
    assert_healthy(limited_server)


def test_dripped_headers_cannot_take_health_down(limited_server: ServerProcess) -> None:
    flood = connect_many(limited_server, FLOOD)
    selector = selectors.DefaultSelector()
    try:
        for sock in flood:
            selector.register(sock, selectors.EVENT_WRITE)
        # Each socket sends its request line, then one header byte at a time; between
        # two rounds of drips, /health is asked.  Until the server has taken the whole
        # flood in (and closed the oldest for room), and for some rounds at least.
        sent = dict.fromkeys(flood, 0)
        num_closed = 0
        rounds = 0
        deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
        while rounds < HEALTH_CHECKS or num_closed < FLOOD - default_max_connections(FILE_LIMIT):
            assert time.monotonic() < deadline, (rounds, num_closed)
            for key, _ in selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                part = b"GET / HTTP/1.1\r\nX-Slow: " if sent[sock] == 0 else b"a"
                try:
                    sock.send(part)
                    sent[sock] += 1
                except OSError:
                    selector.unregister(sock)  # closed by the server: fine
                    num_closed += 1
            health_is_answered(limited_server)
            rounds += 1
        assert open_files(limited_server) < FILE_LIMIT
    finally:
        selector.close()
        for sock in flood:
            sock.close()
    assert_healthy(limited_server)
