"""Admission cannot be starved by parsing: a tenant's request limit is checked before its
body is read, and huge bodies are parsed and tokenised off the event loop."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
KEY = "sk-five"
FLOOD_KEY = "sk-flood"
BURST_OF_FIVE = {"requests_per_second": 0.01, "request_burst": 5}


@pytest.fixture(scope="module")
def five_per_second(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Tenants limited to a burst of 5 requests; bodies up to 2 MiB are accepted."""
    directory = tmp_path_factory.mktemp("parsing")
    config = directory / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                "max_request_body_bytes": 2 * 1024 * 1024,
                "journal_path": str(directory / "jobs.sqlite3"),
                # A burst of 5, then one request every 100 s: no refill while a test runs,
                # however slow the machine (each test has its own tenant).
                "tenants": [
                    {"name": "five", "api_key": KEY, **BURST_OF_FIVE},
                    {"name": "flood", "api_key": FLOOD_KEY, **BURST_OF_FIVE},
                ],
            }
        )
    )
    server = start_server(["--config", str(config)], "parsing")
    yield server
    server.stop()


def receive_response(sock: socket.socket) -> bytes:
    """One whole HTTP response: the headers, then as many bytes as they announce (the body
    may come in a later segment than the headers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_the_request_limit_is_checked_before_the_body_is_read(
    five_per_second: ServerProcess, tmp_path: Path
) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    # Invalid bodies are requests too: these use up the burst of 5.
    for _ in range(5):
        response = httpx.post(five_per_second.v1 + "/completions", json={}, headers=headers)
        assert response.status_code == 400
    # Headers that announce a megabyte, and no body: refused at once, without waiting.
    host, port = five_per_second.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000000\r\n\r\n".encode()
        )
        answer = receive_response(sock)
    assert answer.startswith(b"HTTP/1.1 429 "), answer[:200]
    assert b"rate_limited_requests" in answer or b"requests_per_second" in answer, answer


def test_health_stays_fast_while_clients_send_megabyte_prompts(
    five_per_second: ServerProcess,
) -> None:
    body = json.dumps(
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello world " * 87_000}],
        }  # ~1 MB
    ).encode()
    assert 1_000_000 < len(body) < 2 * 1024 * 1024
    stop = threading.Event()
    statuses: list[int] = []

    def flood() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                response = client.post(
                    five_per_second.v1 + "/chat/completions",
                    content=body,
                    headers={
                        "authorization": f"Bearer {FLOOD_KEY}",
                        "content-type": "application/json",
                    },
                )
                statuses.append(response.status_code)

    clients = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for client in clients:
        client.start()
    latencies = []
    try:
        time.sleep(0.5)
        with httpx.Client(timeout=10) as health:
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert health.get(five_per_second.base_url + "/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.05)
    finally:
        stop.set()
        for client in clients:
            client.join(30)
    # The prompts are over the context (400) or over the tenant's limit (429), never 5xx.
    assert statuses and set(statuses) <= {400, 429}, set(statuses)
    assert 400 in statuses and 429 in statuses
    p50 = statistics.median(latencies)
    p95 = statistics.quantiles(latencies, n=20)[-1]
    assert p50 < 0.1 and p95 < 0.5, (p50, p95)
