"""Shared fixtures: a real server process on a free port, talked to over real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stats(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(self.base_url + "/v1/stats", timeout=5).json()
        return data

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(
    args: list[str], name: str, ready_timeout: float = 120.0, env: dict[str, str] | None = None
) -> ServerProcess:
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"server-{name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluicegate", "serve", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                return ServerProcess(base_url, process, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"server not ready in {ready_timeout}s:\n{log_path.read_text()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(5)


@pytest.fixture(scope="session")
def sim_server() -> Iterator[ServerProcess]:
    """The sim engine at ~1 ms per step: fast enough for many tests, slow enough to overlap."""
    server = start_server(
        [
            "--engine", "sim", "--sim-step-base-ms", "1", "--sim-step-per-token-ms", "0.01",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
        ],
        "sim",
    )  # fmt: skip
    yield server
    stop_server(server)
