"""Connections that send nothing, drip their headers or send a short body are closed on
deadlines; at the connection cap the oldest idle one makes room; every answer written
at this level is JSON in OpenAI's shape."""

from __future__ import annotations

import contextlib
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


def test_the_default_cap_keeps_file_descriptors_in_reserve() -> None:
    assert default_max_connections(1024) == 1024 - RESERVED_FILE_DESCRIPTORS
    assert default_max_connections(100) == 16
    assert default_max_connections(10**6) == MAX_DEFAULT_CONNECTIONS


@pytest.fixture(scope="module")
def strict_server() -> Iterator[ServerProcess]:
    server = start_server(
        [
            "--engine",
            "sim",
            "--header-timeout-seconds",
            "1",
            "--body-timeout-seconds",
            "1",
            "--keep-alive-timeout-seconds",
            "1",
            "--max-connections",
            "16",
        ],
        "connections",
    )
    yield server
    server.stop()


def open_socket(server: ServerProcess) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    started = time.monotonic()
    sock.settimeout(timeout)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received, time.monotonic() - started


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
    assert answer == b"" and 0.8 < seconds < 3.0, (answer, seconds)


@pytest.mark.slow
def test_dripped_headers_get_408_at_the_header_timeout(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(10):
            try:
                sock.sendall(b"X")
            except OSError:
                break
            time.sleep(0.25)
        answer, _ = read_until_closed(sock)
    assert "header_timeout_seconds" in str(error_of(answer, 408)["message"])
    assert time.monotonic() - started < 4.0


@pytest.mark.slow
def test_a_short_body_gets_408_at_the_body_timeout(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        answer, seconds = read_until_closed(sock)
    assert "body_timeout_seconds" in str(error_of(answer, 408)["message"])
    assert seconds < 3.0
    assert "Traceback" not in strict_server.log()


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_closed(strict_server: ServerProcess) -> None:
    with open_socket(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, seconds = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and seconds < 3.0


@pytest.mark.slow
def test_at_the_cap_the_oldest_idle_connection_makes_room(strict_server: ServerProcess) -> None:
    silent = [open_socket(strict_server) for _ in range(20)]
    try:
        time.sleep(0.2)
        health = httpx.get(strict_server.base_url + "/health", timeout=2)
        assert health.status_code == 200
        closed = 0
        for sock in silent[:8]:
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                closed += sock.recv(1) == b""
        assert closed >= 4  # the oldest went first
    finally:
        for sock in silent:
            sock.close()


@pytest.mark.slow
def test_when_every_connection_is_busy_a_newcomer_gets_503(strict_server: ServerProcess) -> None:
    time.sleep(1.5)  # earlier tests' connections have timed out
    busy = []
    try:
        for _ in range(16):  # requests whose bodies are still coming: not idle
            sock = open_socket(strict_server)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
            busy.append(sock)
        time.sleep(0.2)
        with open_socket(strict_server) as newcomer:
            answer, _ = read_until_closed(newcomer)
        error = error_of(answer, 503)
        assert error["code"] == "too_many_connections"
    finally:
        for sock in busy:
            sock.close()
    time.sleep(1.5)
    assert httpx.get(strict_server.base_url + "/health", timeout=2).status_code == 200
