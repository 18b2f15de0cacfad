"""A real server process on a free port, talked to over real sockets.

The process itself is the bench's (:mod:`sluicegate.bench.server_process`: ``bench
compare`` starts its servers the same way; the test extra installs the bench extra);
here each server's log goes to ``test-artifacts/``.  Use it where only a process shows
what is tested (sockets, signals, crashes, replicas, peers, browsers); API behaviour is
tested in process (:mod:`tests.support.inprocess`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args
from tests.support import plain_http
from tests.support.forked import fork_serve

__all__ = [
    "ARTIFACTS",
    "ServerProcess",
    "cancellations",
    "free_port",
    "start_server",
    "start_servers",
]

ARTIFACTS = Path(__file__).resolve().parent.parent.parent / "test-artifacts"


def start_server(
    args: list[str],
    name: str,
    ready_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    port: int | None = None,
    forked: bool | None = None,
) -> ServerProcess:
    """``sluicegate serve`` with ``args`` on a free port (or ``port``), logging to
    ``test-artifacts/server-<name>-<port>.log``; returns once it is ready.  Forked
    (unless ``forked`` is false or a ``preexec_fn`` is given) from a process that has
    imported the server, the embedded engine's included (:mod:`tests.support.forked`:
    0.2 s of CPU to start instead of 1.4, and of 3.2 for the embedded engine);
    ``tests/test_cli.py`` and ``tests/test_wheel.py`` start the command afresh.

    Stop it with :meth:`ServerProcess.stop`.
    """
    port = port or free_port()
    log_path = ARTIFACTS / f"server-{name}-{port}.log"
    if forked is None:
        forked = preexec_fn is None
    if not forked:
        return start_server_with_args(
            args,
            log_path,
            port=port,
            ready_timeout_seconds=ready_timeout,
            env=env,
            preexec_fn=preexec_fn,
        )
    assert preexec_fn is None, "a forked server runs no preexec_fn"
    command = [*args, "--host", "127.0.0.1", "--port", str(port)]
    process = fork_serve(command, log_path, {**os.environ, **(env or {})})
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)  # type: ignore[arg-type]
    what = f"the server `sluicegate serve {' '.join(args)}`"
    deadline = time.monotonic() + ready_timeout
    with plain_http.client() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with code {process.returncode}; {tail(server)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(server.base_url + "/ready", timeout=1.0).status_code == 200:
                    return server
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"{what} was not ready in {ready_timeout:g}s; {tail(server)}")


def tail(server: ServerProcess, num_lines: int = 30) -> str:
    """The end of ``server``'s log, for an error message."""
    lines = server.log().splitlines() if server.log_path.exists() else ["(no log)"]
    return f"its log ({server.log_path}):\n" + "\n".join(lines[-num_lines:])


def start_servers(*specs: tuple[list[str], str]) -> list[ServerProcess]:
    """:func:`start_server` (forked) for each ``(args, name)``, all at once: each start
    is mostly waiting for the new process to be ready, so starts overlap.  All or none:
    if one fails, those that started are stopped and its error raised."""
    with contextlib.ExitStack() as held:
        # Each its own port: bound together, the ports differ.
        sockets = [held.enter_context(socket.socket()) for _ in specs]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        ports = [int(sock.getsockname()[1]) for sock in sockets]

    def start(spec: tuple[list[str], str], port: int) -> ServerProcess:
        return start_server(*spec, port=port, forked=True)

    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        futures = [pool.submit(start, spec, port) for spec, port in zip(specs, ports, strict=True)]
    started = [f.result() for f in futures if f.exception() is None]
    for future in futures:
        if (error := future.exception()) is not None:
            for server in started:
                server.stop()
            raise error
    return started


def cancellations(server: ServerProcess) -> float:
    """The server's ``sluicegate_cancellations_total``: sequences aborted because their
    client disconnected or cancelled (each counted once)."""
    return plain_http.metrics(server).total("sluicegate_cancellations_total")
