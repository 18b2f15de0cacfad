"""Start and stop our own server (``python -m sluicegate serve``) as a child process.

The one implementation for ``bench compare`` and ``bench engine`` (a server from a YAML
config) and for the end-to-end tests (a server from CLI flags).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from sluicegate.bench.scrape import MetricsSnapshot, admin_headers, parse_metrics
from sluicegate.config import read_config_file

#: How often a starting server's ``/ready`` is polled.
READY_POLL_INTERVAL_SECONDS = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class ServerProcess:
    """A server child process on ``base_url``, logging to ``log_path``."""

    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def v1(self) -> str:
        """The OpenAI API's base URL (what an OpenAI client takes as ``base_url``)."""
        return self.base_url + "/v1"

    def stats(self, timeout_seconds: float = 5.0) -> dict[str, Any]:
        """The server's ``GET /v1/stats`` snapshot."""
        response = httpx.get(self.v1 + "/stats", headers=admin_headers(), timeout=timeout_seconds)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def metrics(self, timeout_seconds: float = 5.0) -> MetricsSnapshot:
        """Every sample of the server's ``GET /metrics`` (see :class:`MetricsSnapshot`)."""
        response = httpx.get(
            self.base_url + "/metrics", headers=admin_headers(), timeout=timeout_seconds
        )
        response.raise_for_status()
        return parse_metrics(response.text)

    def wait_calibrated(self, timeout_seconds: float = 180.0, poll_seconds: float = 0.5) -> bool:
        """Until the server's start-up calibration is complete (it finishes it while idle;
        a server without one counts as complete); False if not within the timeout."""
        give_up = time.monotonic() + timeout_seconds
        while time.monotonic() < give_up:
            if self.stats().get("calibration", {}).get("complete", True):
                return True
            time.sleep(poll_seconds)
        return False

    def log(self) -> str:
        """Everything the server has written to its log so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_seconds: float = 10.0) -> int:
        """Terminate (SIGTERM, then SIGKILL after the timeout); the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5.0)
        return int(self.process.returncode)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def server_settings(config_path: Path) -> dict[str, Any]:
    """The settings a YAML config file sets, for the report (API keys redacted)."""
    settings: dict[str, Any] = _redact(read_config_file(config_path))
    return settings


def _redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "***" if "key" in str(k).lower() else _redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def start_server(
    config_path: Path,
    log_path: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    ready_timeout_seconds: float = 180.0,
    extra_args: Sequence[str] = (),
) -> ServerProcess:
    """Start a server with ``--config``, wait for ``/ready``; raise with its log if it fails."""
    return start_server_with_args(
        ["--config", str(config_path), *extra_args],
        log_path,
        host=host,
        port=port,
        ready_timeout_seconds=ready_timeout_seconds,
    )


def start_server_with_args(
    args: Sequence[str],
    log_path: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    ready_timeout_seconds: float = 180.0,
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """Start ``sluicegate serve`` with ``args`` (``--host``/``--port`` are added), its output
    to ``log_path``, and wait for ``/ready``; raise with its log if it fails.

    ``env`` adds to (or overrides) this process's environment; ``preexec_fn`` runs in the
    child before the server (to lower a resource limit, say).
    """
    port = port or free_port(host)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "sluicegate",
        "serve",
        *args,
        "--host",
        host,
        "--port",
        str(port),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec_fn,
        )
    server = ServerProcess(f"http://{host}:{port}", process, log_path)
    what = f"the server `sluicegate serve {' '.join(args)}`"
    deadline = time.monotonic() + ready_timeout_seconds
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                server.stop()
                raise RuntimeError(
                    f"{what} exited with code {process.returncode}; "
                    f"its log ({log_path}):\n{_tail(log_path)}"
                )
            try:
                if client.get(server.base_url + "/ready", timeout=1.0).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(READY_POLL_INTERVAL_SECONDS)
    server.stop()
    raise RuntimeError(
        f"{what} was not ready in {ready_timeout_seconds:g}s; "
        f"its log ({log_path}):\n{_tail(log_path)}"
    )


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
