"""Server-sent events over ASGI, flow-controlled.

The writer sends each flush with ``await send()``, which blocks while uvicorn's
transport is above its write-buffer high-water mark, and records what it wrote so flow
control can tell how much the client has really received.  A disconnect listener runs
beside it: a client that goes away aborts its sequence at once, even while nothing is
being written (queued or paused).  A stalled client is evicted: the writer is cancelled,
a final error event is written past the blocked send, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sluicegate.stream.flow import FlowController, StreamFlow

logger = logging.getLogger(__name__)

SSE_HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
    "connection": "keep-alive",
}
DONE = b"data: [DONE]\n\n"
TRANSPORT_SCOPE_KEY = "sluicegate.transport"


def sse_data(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_comment(text: str) -> bytes:
    return b": " + text.encode() + b"\n\n"


def _chunk_framing_bytes(num_bytes: int) -> int:
    # HTTP/1.1 chunked encoding: "<hex length>\r\n" + body + "\r\n".
    return len(f"{num_bytes:x}") + 4


class TransportCapture:
    """Outermost ASGI middleware: puts the connection's transport into the scope.

    uvicorn's ``send`` is a bound method of its request cycle, which holds the
    transport; flow control needs it to read the socket's unacknowledged bytes.
    Without it (another server), flow control falls back to counting unwritten tokens.
    """

    def __init__(self, app: Any, write_buffer_high_bytes: int | None = None) -> None:
        self.app = app
        self.write_buffer_high_bytes = write_buffer_high_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None:
                scope[TRANSPORT_SCOPE_KEY] = transport
                if self.write_buffer_high_bytes is not None:
                    # Small user-space buffer: `await send()` blocks early for a slow reader.
                    with contextlib.suppress(Exception):
                        high = self.write_buffer_high_bytes
                        transport.set_write_buffer_limits(high=high, low=high // 4)
        await self.app(scope, receive, send)


class EventStreamResponse(Response):
    """Streams ``(bytes, num_tokens)`` events as ``text/event-stream`` under flow control."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[tuple[bytes, int]],
        stream_flow: StreamFlow,
        controller: FlowController | None,
        on_close: Callable[[], None],
        eviction_event: Callable[[], bytes],
        headers: dict[str, str] | None = None,
        on_send_blocked: Callable[[float], None] | None = None,
    ) -> None:
        # Not Response.__init__: it would add a Content-Length to a body that has none.
        self.status_code = 200
        self.background = None
        merged = {**SSE_HEADERS, "content-type": "text/event-stream; charset=utf-8"}
        merged.update(headers or {})
        self.raw_headers = [(k.lower().encode(), v.encode()) for k, v in merged.items()]
        self._events = events
        self._flow = stream_flow
        self._controller = controller
        self._on_close = on_close
        self._eviction_event = eviction_event
        self._on_send_blocked = on_send_blocked
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None
        flow = self._flow
        transport = scope.get(TRANSPORT_SCOPE_KEY)
        flow.transport = transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def evict() -> None:
            writer.cancel()

        flow.on_evict = evict

        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    self._on_close()
                    writer.cancel()
                    return

        listener = asyncio.create_task(listen())
        if self._controller is not None:
            self._controller.register(flow)
        loop = asyncio.get_running_loop()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data, num_tokens in self._events:
                started = loop.time()
                flow.sending = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
                flow.sending = False
                if self._on_send_blocked is not None:
                    self._on_send_blocked(loop.time() - started)
                flow.record_write(len(data) + _chunk_framing_bytes(len(data)), num_tokens)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (self.disconnected or flow.evicted):
                raise
            writer.uncancel()  # our own cancel (disconnect or eviction): finish normally
            if flow.evicted:
                self._write_eviction(transport)
        except OSError:
            self.disconnected = True
        finally:
            # Always: a stream that ends for any reason must not leave its sequence running.
            self._on_close()
            if self._controller is not None:
                self._controller.unregister(flow.stream.request_id)
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()

    def _write_eviction(self, transport: Any) -> None:
        """Past the blocked ``send``: a final error event, the last chunk, then close."""
        if transport is None or transport.is_closing():
            return
        body = self._eviction_event() + DONE
        transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        transport.close()
        # A reader that never reads would keep the closing transport forever.
        asyncio.get_running_loop().call_later(2.0, transport.abort)
