"""Run the app under uvicorn (uvloop, httptools) on a socket we create ourselves.

Every start-up failure (a missing model, a port in use, an unreachable store, an engine
that fails to load) ends the process with one line on stderr and exit code 1; bad
settings are caught before this, by the CLI.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from sluicegate.api.app import create_app
from sluicegate.api.lifecycle import drain
from sluicegate.api.state import AppState
from sluicegate.config import Settings
from sluicegate.connections import (
    RESERVED_FILE_DESCRIPTORS,
    ConnectionGuard,
    ConnectionLimits,
    default_max_connections,
    guarded_protocol,
    raise_open_file_limit,
)
from sluicegate.engine.families import model_architecture
from sluicegate.metrics.request_log import configure_request_log
from sluicegate.metrics.tracing import setup_tracing
from sluicegate.stream.sse import TransportCapture


def make_listen_socket(host: str, port: int, send_buffer_bytes: int = 0) -> socket.socket:
    """The listening socket; accepted sockets inherit its SO_SNDBUF on Linux.

    A small send buffer keeps the distance between what we wrote and what the reader
    received short, so a slow reader is seen after kilobytes, not megabytes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a graceful drain instead of an abrupt stop.

    The listening socket stays open while draining, so new requests get an honest 503
    with ``Retry-After`` rather than a refused connection; a second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._drain_task: asyncio.Task[None] | None = None
        #: Why the server stopped on its own (the engine failed to load), if it did.
        self.fatal_error: str | None = None

    def fail(self, reason: str) -> None:
        """Stop serving at once: the server cannot work (see :attr:`fatal_error`)."""
        self.fatal_error = reason
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)
            return
        loop = asyncio.get_event_loop()
        self._drain_task = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self._app.state.sluicegate)
        finally:
            self.should_exit = True


#: How long a thread waiting for the GIL waits before the holder is asked to let go.  The
#: engine thread runs Python between its tensor operations; at Python's default (5 ms) a
#: request the event loop could answer in a millisecond (a refusal, an SSE write) can wait
#: several of those turns.
SWITCH_INTERVAL_SECONDS = 0.001


def tune_process() -> None:
    """Process-wide settings for a server whose engine shares the interpreter."""
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)


def run_server(settings: Settings) -> None:
    """Serve until stopped; raises ``SystemExit`` with one line when the server cannot
    start or its engine cannot load."""
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per upstream call and health check would drown the log (debug shows them).
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    tune_process()
    check_model_path(settings)
    open_file_limit = raise_open_file_limit()
    try:
        sock = make_listen_socket(settings.host, settings.port, settings.socket_send_buffer_bytes)
    except OSError as error:
        raise SystemExit(
            f"sluicegate: cannot listen on {settings.host}:{settings.port}: "
            f"{error.strerror or error} (--host, --port)"
        ) from None
    configure_request_log(settings.request_log)
    setup_tracing()
    fastapi_app = create_app(settings)
    app = TransportCapture(fastapi_app, settings.transport_write_buffer_bytes)
    limits = ConnectionLimits(
        max_connections=settings.max_connections or default_max_connections(open_file_limit),
        header_timeout_seconds=settings.header_timeout_seconds,
        body_timeout_seconds=settings.body_timeout_seconds,
        max_header_bytes=settings.max_header_bytes,
    )
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=guarded_protocol(ConnectionGuard(limits)),
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=max(1, round(settings.keep_alive_timeout_seconds)),
        ws_max_size=settings.max_request_body_bytes,
    )
    safe_cap = open_file_limit - RESERVED_FILE_DESCRIPTORS
    if limits.max_connections > safe_cap:
        logging.getLogger("sluicegate").warning(
            "max_connections %d exceeds what the open-file limit (%d) leaves room for (%d): "
            "past that, connections are refused by the kernel instead of managed",
            limits.max_connections,
            open_file_limit,
            safe_cap,
        )
    server = DrainingServer(config, fastapi_app)
    state = fastapi_app.state.sluicegate
    assert isinstance(state, AppState)
    state.on_fatal = server.fail
    state.owns_process = True
    logging.getLogger("sluicegate").info(
        "listening on http://%s:%d (engine %s, at most %d connections)",
        settings.host,
        sock.getsockname()[1],
        settings.engine,
        limits.max_connections,
    )
    server.run(sockets=[sock])
    if server.fatal_error is not None:
        raise SystemExit(f"sluicegate: {server.fatal_error}")


def check_model_path(settings: Settings) -> None:
    """A model path that does not exist is a one-line error before anything starts."""
    if settings.engine != "torch" or settings.model is None:
        return
    path = Path(settings.model).expanduser()
    if not path.exists():
        raise SystemExit(
            f"sluicegate: the model {settings.model} does not exist (--model): give a GGUF "
            "file or a Hugging Face model directory, or leave --model out for the built-in "
            "SmolLM2-135M-Instruct"
        )
    # What can be told from a glance at the path, before the server starts (the rest
    # of a model's problems show when it loads, after start-up).
    if path.is_dir() and not (path / "config.json").is_file():
        raise SystemExit(
            f"sluicegate: the model directory {settings.model} has no config.json (--model): "
            "give a Hugging Face model directory or a GGUF file"
        )
    if path.is_file():
        with path.open("rb") as file:
            magic = file.read(4)
        if magic != b"GGUF":
            raise SystemExit(
                f"sluicegate: the model {settings.model} is not a GGUF file (it does not "
                "start with GGUF) (--model): give a GGUF file or a Hugging Face model directory"
            )
    found = model_architecture(path)
    if found is not None and found[0] not in found[1]:
        raise SystemExit(
            f"sluicegate: the model {settings.model} is a {found[0]!r} model, which the "
            f"embedded engine does not run (it runs {', '.join(found[1])}) (--model): serve "
            "it with an engine that does and --engine upstream in front"
        )
