"""A real server process on a free port, talked to over real sockets.

The process itself is the bench's (:mod:`sluicegate.bench.server_process`: ``bench
compare`` starts its servers the same way; the test extra installs the bench extra);
here each server's log goes to ``test-artifacts/``.  Use it where only a process shows
what is tested (sockets, signals, crashes, replicas, peers, browsers); API behaviour is
tested in process (:mod:`tests.support.inprocess`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args

__all__ = ["ARTIFACTS", "ServerProcess", "cancellations", "free_port", "start_server"]

ARTIFACTS = Path(__file__).resolve().parent.parent.parent / "test-artifacts"


def start_server(
    args: list[str],
    name: str,
    ready_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """``sluicegate serve`` with ``args`` on a free port, logging to
    ``test-artifacts/server-<name>-<port>.log``; returns once it is ready.

    Stop it with :meth:`ServerProcess.stop`.
    """
    port = free_port()
    return start_server_with_args(
        args,
        ARTIFACTS / f"server-{name}-{port}.log",
        port=port,
        ready_timeout_seconds=ready_timeout,
        env=env,
        preexec_fn=preexec_fn,
    )


def cancellations(server: ServerProcess) -> float:
    """The server's ``sluicegate_cancellations_total``: sequences aborted because their
    client disconnected or cancelled (each counted once)."""
    return server.metrics().total("sluicegate_cancellations_total")
