"""Connections that send nothing, drip their headers or send a short body are closed on
deadlines; at the connection cap the oldest idle one makes room; every answer written
at this level is JSON in OpenAI's shape."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from sluicegate.connections import (
    MAX_DEFAULT_CONNECTIONS,
    RESERVED_FILE_DESCRIPTORS,
    default_max_connections,
)
from tests.support.servers import ServerProcess, start_server

# The tests that share a server run on one pytest-xdist worker (make test), which starts it
# once.


def test_the_default_cap_keeps_file_descriptors_in_reserve() -> None:
    assert default_max_connections(1024) == 1024 - RESERVED_FILE_DESCRIPTORS
    assert default_max_connections(100) == 16
    assert default_max_connections(10**6) == MAX_DEFAULT_CONNECTIONS


#: The strict server's deadlines (header, body, keep-alive).
STRICT_SECONDS = 0.5
#: Only a broken server keeps a connection open this long.
DEADLINE_SECONDS = 30.0
#: The deadlines' lower bound, with room for when the client starts its clock (just
#: before or after the server has taken the connection in).
AT_LEAST_SECONDS = STRICT_SECONDS - 0.2


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerProcess]:
    """Short deadlines: silent, dripping and idle connections are closed on them."""
    server = start_server(
        [
            "--engine",
            "sim",
            "--header-timeout-seconds",
            str(STRICT_SECONDS),
            "--body-timeout-seconds",
            str(STRICT_SECONDS),
            "--keep-alive-timeout-seconds",
            str(STRICT_SECONDS),
            "--max-connections",
            "16",
        ],
        "connections",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def capped_server() -> Iterator[ServerProcess]:
    """16 connections at most, and deadlines longer than any test: whatever closes a
    connection here is the cap."""
    server = start_server(
        [
            "--engine",
            "sim",
            "--header-timeout-seconds",
            "600",
            "--body-timeout-seconds",
            "600",
            "--keep-alive-timeout-seconds",
            "600",
            "--max-connections",
            "16",
        ],
        "connections-capped",
    )
    yield server
    server.stop()


def open_socket(server: ServerProcess) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=DEADLINE_SECONDS)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    started = time.monotonic()
    sock.settimeout(DEADLINE_SECONDS)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - started


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock``, without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False  # open, nothing to read
    except OSError:
        return True  # reset
    finally:
        sock.setblocking(True)


def error_of(answer: bytes, status: int) -> dict[str, object]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:300]
    assert b"content-type: application/json" in head.lower()
    error: dict[str, object] = orjson.loads(body)["error"]
    return error


@pytest.mark.slow
def test_a_silent_connection_is_closed_after_the_header_timeout(
    strict_server: ServerProcess,
) -> None:
    with open_socket(strict_server) as sock:
        answer, seconds = read_until_closed(sock)
    # Closed (uvicorn alone would keep it for ever), and not before the deadline.
    assert answer == b"" and seconds > AT_LEAST_SECONDS, (answer, seconds)


@pytest.mark.slow
def test_dripped_headers_get_408_at_the_header_timeout(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        # A header byte every 0.1 s for as long as the connection lasts: were the deadline
        # renewed by each byte, it would last until this test gave up.
        answer = b""
        while not answer:
            assert time.monotonic() - started < DEADLINE_SECONDS, "never answered"
            try:
                sock.sendall(b"X")
                sock.settimeout(0.1)
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        rest, _ = read_until_closed(sock)
    assert "header_timeout_seconds" in str(error_of(answer + rest, 408)["message"])
    assert time.monotonic() - started > AT_LEAST_SECONDS


@pytest.mark.slow
def test_a_short_body_gets_408_at_the_body_timeout(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        answer, seconds = read_until_closed(sock)
    assert "body_timeout_seconds" in str(error_of(answer, 408)["message"])
    assert seconds > AT_LEAST_SECONDS
    assert "Traceback" not in strict_server.log()


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_closed(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, seconds = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and seconds > AT_LEAST_SECONDS


@pytest.mark.slow
def test_at_the_cap_the_oldest_idle_connection_makes_room(capped_server: ServerProcess) -> None:
    silent = [open_socket(capped_server) for _ in range(20)]
    try:
        health = httpx.get(capped_server.base_url + "/health", timeout=DEADLINE_SECONDS)
        assert health.status_code == 200
        # 21 connections for 16 places: the five oldest silent ones made room.  No
        # deadline closes anything here: the closed ones are the oldest, the newest open.
        deadline = time.monotonic() + DEADLINE_SECONDS
        while sum(closed_by_server(sock) for sock in silent[:8]) < 4:
            assert time.monotonic() < deadline, "the oldest connections were not closed"
            time.sleep(0.02)
        closed = [closed_by_server(sock) for sock in silent]
        assert closed == sorted(closed, reverse=True), closed  # a run of the oldest
        assert not any(closed[12:]), closed
    finally:
        for sock in silent:
            sock.close()


@pytest.mark.slow
def test_when_every_connection_is_busy_a_newcomer_gets_503(capped_server: ServerProcess) -> None:
    busy = []
    try:
        for _ in range(16):  # requests whose bodies are still coming: not idle
            sock = open_socket(capped_server)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                b"Expect: 100-continue\r\n\r\n{"
            )
            # The app asks for the body: the server has the request, and counts it busy.
            assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")
            busy.append(sock)
        with open_socket(capped_server) as newcomer:
            answer, _ = read_until_closed(newcomer)
        error = error_of(answer, 503)
        assert error["code"] == "too_many_connections"
    finally:
        for sock in busy:
            sock.close()
    # Once they are gone, there is room again (as soon as the server has seen them go).
    deadline = time.monotonic() + DEADLINE_SECONDS
    while (
        httpx.get(capped_server.base_url + "/health", timeout=DEADLINE_SECONDS).status_code != 200
    ):
        assert time.monotonic() < deadline, "no room after the busy connections left"
        time.sleep(0.05)
