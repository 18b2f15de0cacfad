"""Start and stop our own server (``python -m sluicegate serve``) for ``bench compare``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from sluicegate.config import read_config_file


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class ServerProcess:
    """A server child process on ``base_url``, logging to ``log_path``."""

    config_path: Path
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

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
    extra_args: list[str] | None = None,
) -> ServerProcess:
    """Start a server with ``--config``, wait for ``/ready``; raise with its log if it fails."""
    port = port or free_port(host)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "sluicegate", "serve", "--config", str(config_path),
        "--host", host, "--port", str(port), *(extra_args or []),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
    server = ServerProcess(config_path, f"http://{host}:{port}", process, log_path)
    deadline = time.monotonic() + ready_timeout_seconds
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                server.stop()
                raise RuntimeError(
                    f"the server for {config_path} exited with code {process.returncode}; "
                    f"its log ({log_path}):\n{_tail(log_path)}"
                )
            try:
                if client.get(server.base_url + "/ready", timeout=1.0).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(
        f"the server for {config_path} was not ready in {ready_timeout_seconds:g}s; "
        f"its log ({log_path}):\n{_tail(log_path)}"
    )


def _tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
