"""``sluicegate serve`` processes forked from one that has imported the server already.

A server process started afresh spends about 1.4 s of CPU and 2 s importing before it
serves; the suite starts a hundred.  A fork server (``multiprocessing``'s) imports
:data:`PRELOAD` once per test process, and each server is a fork of it that runs the
CLI with its flags, its output in its log: about 0.2 s of CPU.  It is the same command,
in a process of its own, on its own port, with its own signals and exit code; what it
does not go through is the interpreter's start and those imports, which every server
started the ordinary way (:mod:`tests.support.servers`, ``tests/test_cli.py``) does.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import weakref
from multiprocessing import forkserver
from pathlib import Path

#: What serving the sim, upstream and embedded engines (with either store) imports, up to
#: what it imports only when it serves (uvicorn's loop and protocols, anyio's backend).
#: No Python thread runs after these imports (numpy's BLAS has an idle one of its own, as
#: it had before torch was added here): forking the process that made them is safe.
#: Torch reads no setting of a test's at import (its threads are set when an engine
#: starts).
PRELOAD = [
    "sluicegate.cli",
    "sluicegate.server",
    "sluicegate.api.app",
    "sluicegate.engine.factory",
    "sluicegate.engine.sim",
    "sluicegate.engine.torch",
    "sluicegate.engine.upstream.core",
    "sluicegate.store.factory",
    "sluicegate.store.redis_store",
    "uvicorn.lifespan.on",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
    "anyio._backends._asyncio",
]

#: prctl(2)'s option: a signal the process gets when its parent ends.
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
#: Every server forked here (to stop any a test left running when the tests end).
_FORKED: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()


class ForkedProcess:
    """A forked server, as much of :class:`subprocess.Popen` as the tests use (the fork
    server reaps it and reports its exit code: it is not this process's child)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.args = process.name

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_serve(args: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
    """``sluicegate serve`` with ``args`` (``--host``/``--port`` included), in this
    process's directory with ``env`` as its environment, its output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = _CONTEXT.Process(
        target=_serve,
        args=(args, str(log_path), env, os.getcwd()),
        name=f"sluicegate serve {' '.join(args)}",
        daemon=True,  # one a test left running is stopped when the tests end
    )
    process.start()
    _FORKED.add(process)
    return ForkedProcess(process)


def _serve(args: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """The forked child: its output to its log, then the CLI, as ``python -m sluicegate
    serve`` runs it (its exit code is the CLI's)."""
    # Ended with the fork server, which ends with its test process (a worker that
    # pytest-timeout ends at once, its thread method, leaves no server running): the
    # fork server ends once every holder of its "alive" pipe has, and multiprocessing
    # hands that pipe to each child it forks, in case the child forks in turn.  A server
    # does not: it lets go of it.
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["sluicegate", "serve", *args]
    from sluicegate.cli import main

    main()


@atexit.register
def _stop_fork_server() -> None:
    # Any server a test left running, then the fork server (which has reaped the servers
    # it forked): their CPU time then counts in this process's children's, as that of
    # servers started afresh would.
    for process in list(_FORKED):
        if process.exitcode is None:
            process.terminate()
            process.join(10)
    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()
