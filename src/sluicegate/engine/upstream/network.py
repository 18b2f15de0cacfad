"""The gateway's sockets to its upstreams: what an upstream sends is read no faster than
the relay takes it.

``httpx`` reads through ``httpcore``, whose default network backend (anyio's socket
streams) queues every chunk the event loop reads, without a bound: under uvloop one
wakeup reads up to 32 times 256 KB, so an upstream that writes a 10 MB event had the
whole of it held in the gateway per connection, whatever the relay's own line limit
(``upstream_max_event_bytes``) then refused.  This backend is built on asyncio's streams,
which stop reading from the socket once :data:`READ_BUFFER_BYTES` twice over are waiting
(the kernel's buffers, then TCP's window, hold the rest back at the upstream), so a
connection costs at most a few hundred KB of the gateway's memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

#: asyncio's stream limit: reading pauses above twice this much unread.
READ_BUFFER_BYTES = 64 * 1024


@contextlib.contextmanager
def _mapped(timeout: type[Exception], error: type[Exception]) -> Iterator[None]:
    try:
        yield
    except TimeoutError as exc:
        raise timeout(str(exc) or "timed out") from exc
    except (OSError, ssl.SSLError, EOFError) as exc:
        raise error(str(exc) or type(exc).__name__) from exc


class BoundedStream(httpcore.AsyncNetworkStream):
    """One connection to an upstream, on asyncio's flow-controlled streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    # httpcore's interface passes each call's timeout (ruff's ASYNC109 would not have it).
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        with _mapped(httpcore.ReadTimeout, httpcore.ReadError):
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        with _mapped(httpcore.WriteTimeout, httpcore.WriteError):
            self._writer.write(buffer)
            async with asyncio.timeout(timeout):
                await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            # A TLS close waits for the peer's answer: not for long.
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info == "is_readable":
            # An idle kept-alive connection that is readable was closed by its upstream
            # (or sent what nobody asked for): httpcore then opens another.
            return self._reader.at_eof() or self._writer.is_closing() or self._socket_readable()
        return None

    def _socket_readable(self) -> bool:
        sock = self._writer.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))


class BoundedBackend(httpcore.AsyncNetworkBackend):
    """``httpcore``'s network backend for upstream connections (TCP or Unix sockets)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host,
                    port,
                    limit=READ_BUFFER_BYTES,
                    local_addr=(local_address, 0) if local_address else None,
                )
        sock: socket.socket = writer.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return BoundedStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        with _mapped(httpcore.ConnectTimeout, httpcore.ConnectError):
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path, limit=READ_BUFFER_BYTES)
        return BoundedStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def bounded_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """``httpx``'s transport (TLS, pooling, retries as usual) on :class:`BoundedBackend`.

    httpx takes no network backend of its own: the pool it builds is given one here (the
    only reach into its internals; ``tests/upstream/test_network.py`` fails if
    that pool or attribute ever goes)."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    pool = transport._pool
    if not hasattr(pool, "_network_backend"):
        raise RuntimeError("httpx's connection pool has no network backend to bound")
    pool._network_backend = BoundedBackend()
    return transport
