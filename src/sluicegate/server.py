"""Run the app under uvicorn (uvloop, httptools) on a socket we create ourselves."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from sluicegate.api.app import create_app
from sluicegate.api.lifecycle import drain
from sluicegate.config import Settings
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


def run_server(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    configure_request_log(settings.request_log)
    setup_tracing()
    fastapi_app = create_app(settings)
    app = TransportCapture(fastapi_app, settings.transport_write_buffer_bytes)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, fastapi_app)
    sock = make_listen_socket(settings.host, settings.port, settings.socket_send_buffer_bytes)
    logging.getLogger("sluicegate").info(
        "listening on http://%s:%d (engine %s)", settings.host, sock.getsockname()[1],
        settings.engine,
    )  # fmt: skip
    server.run(sockets=[sock])
