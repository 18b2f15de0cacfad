"""The gateway's upstream connections hold a bounded amount of what an upstream sends
(``engine/upstream/network.py``), on uvloop as the server runs.

An upstream writes a 16 MB body at once; the client reads its first megabyte the way the
relay does (``aiter_bytes``, one chunk at a time) and the peak of Python's allocations
meanwhile is taken with tracemalloc. On httpx's default backend that peak is megabytes
(anyio queues every read of uvloop's, up to 32 x 256 KB a wakeup); on the gateway's,
a few hundred KB.
"""

from __future__ import annotations

import asyncio
import tracemalloc

import httpx
import pytest
import uvloop

from sluicegate.engine.upstream.network import BoundedBackend, bounded_transport

BODY_BYTES = 16 << 20
READ_BYTES = 1 << 20
LIMITS = httpx.Limits(max_connections=4)
#: Made before the measurement: the upstream (in this process) holds it, not the client.
BODY = b"x" * BODY_BYTES


async def _blast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET /warm"):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()
        return
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"content-length: " + str(BODY_BYTES).encode() + b"\r\n\r\n"
    )
    writer.write(BODY)
    try:
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _peak_while_reading(transport: httpx.AsyncBaseTransport) -> int:
    """Bytes allocated at the peak, over the level before, while the first megabyte
    of the blast is read."""
    server = await asyncio.start_server(_blast, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with httpx.AsyncClient(transport=transport) as client:
        # A first request imports and allocates what any first request does.
        (await client.get(f"http://127.0.0.1:{port}/warm")).raise_for_status()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/x") as response:
                await asyncio.sleep(0.2)  # the upstream's writes fill the socket's buffers
                read = 0
                async for chunk in response.aiter_bytes():
                    read += len(chunk)
                    if read >= READ_BYTES:
                        break
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    server.close()
    await server.wait_closed()
    return peak - before


def test_a_blasting_upstream_costs_a_bounded_read_buffer() -> None:
    peak = uvloop.run(_peak_while_reading(bounded_transport(LIMITS)))
    assert peak < 2 * READ_BYTES, f"{peak / 2**20:.1f} MiB held for 1 MiB read"


def test_httpx_default_backend_holds_megabytes_there() -> None:
    """Why the gateway has its own backend: the same read on httpx's default one holds
    what uvloop read ahead (if this fails, httpx bounds it now and the backend could go)."""
    peak = uvloop.run(_peak_while_reading(httpx.AsyncHTTPTransport(limits=LIMITS)))
    assert peak > 2 * READ_BYTES, f"only {peak / 2**20:.1f} MiB"


def test_the_pool_takes_the_bounded_backend() -> None:
    transport = bounded_transport(LIMITS)
    assert isinstance(transport._pool._network_backend, BoundedBackend)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/", "http://[::1]:9/"])
def test_a_refused_connection_is_httpx_s_connect_error(url: str) -> None:
    async def ask() -> None:
        async with httpx.AsyncClient(transport=bounded_transport(LIMITS)) as client:
            await client.get(url)

    with pytest.raises(httpx.ConnectError):
        uvloop.run(ask())
