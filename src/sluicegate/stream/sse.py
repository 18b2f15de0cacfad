"""Server-sent events over ASGI, flow-controlled.

The writer sends each flush with ``await send()``, which blocks while uvicorn's
transport is above its write-buffer high-water mark, and records what it wrote so flow
control can tell how much the client has really received.  A disconnect listener runs
beside it: a client that goes away aborts its sequence at once, even while nothing is
being written (queued or paused).  A stalled client is evicted: the writer is cancelled,
a final error event is written past the blocked send, and the connection is closed.

A connection reads a resumable stream (:mod:`sluicegate.stream.session`), which may outlive
it: :class:`SSEConnection` is what the response knows of its socket, and the stream binds
its flow control to it when it attaches (possibly late: a connection that follows a
stream generated on another replica binds only if it takes the stream over).

Every logged event carries ``id: <stream-id>:<seq>`` after its ``data:`` line.  Comments
(queue position, keep-alive) sent after an event id are a single line, not a blank-line
terminated block: once a client has seen an id, some SSE decoders (the ``openai`` Python
client's among them) dispatch an empty event at every blank line, and then fail to parse
it as JSON.
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

from sluicegate.stream.flow import StreamFlow

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


def sse_comment(text: str, *, after_event_id: bool = False) -> bytes:
    """An SSE comment; one line only once the client has seen an event id (see above)."""
    return b": " + text.encode() + (b"\n" if after_event_id else b"\n\n")


def with_event_id(data: bytes, event_id: str) -> bytes:
    """``data`` (one or more SSE messages) with ``id: event_id`` on its first message.

    The messages after the first share its id: a client's last event id stays the same
    until the next id, which is right, since they were logged as one event.
    """
    end = data.index(b"\n\n")
    return data[:end] + b"\nid: " + event_id.encode() + data[end:]


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


class SSEConnection:
    """One SSE response's socket, and the stream flow bound to it (if any).

    The writer sets :attr:`transport` and :attr:`evict` when it starts; a stream binds its
    :class:`StreamFlow` (with the attachment number that makes this connection current)
    and the callbacks to run when the connection closes or is evicted.
    """

    __slots__ = (
        "attachment",
        "evict",
        "eviction_event",
        "flow",
        "on_close",
        "sent_event_id",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: Any = None
        self.evict: Callable[[], None] | None = None
        self.flow: StreamFlow | None = None
        self.attachment = 0
        self.on_close: Callable[[], None] | None = None
        self.eviction_event: Callable[[], bytes] | None = None
        #: An event id was written (comments become single lines from then on).
        self.sent_event_id = False

    def bind(
        self,
        flow: StreamFlow,
        attachment: int,
        on_close: Callable[[], None],
        eviction_event: Callable[[], bytes],
    ) -> None:
        self.flow = flow
        self.attachment = attachment
        self.on_close = on_close
        self.eviction_event = eviction_event
        self._bind_transport()

    def start(self, transport: Any, evict: Callable[[], None]) -> None:
        self.transport = transport
        self.evict = evict
        self._bind_transport()

    @property
    def current_flow(self) -> StreamFlow | None:
        """The bound flow while this connection is its current attachment."""
        flow = self.flow
        return flow if flow is not None and flow.attachment == self.attachment else None

    def comment(self, text: str) -> bytes:
        return sse_comment(text, after_event_id=self.sent_event_id)

    def _bind_transport(self) -> None:
        flow = self.current_flow
        if flow is not None and self.evict is not None:
            flow.transport = self.transport
            flow.on_evict = self.evict


class EventStreamResponse(Response):
    """Streams ``(bytes, num_tokens)`` events as ``text/event-stream`` under flow control."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[tuple[bytes, int]],
        connection: SSEConnection,
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
        self._connection = connection
        self._on_send_blocked = on_send_blocked
        self.disconnected = False

    def _close(self) -> None:
        on_close = self._connection.on_close
        if on_close is not None:
            on_close()

    def _evicted(self) -> bool:
        flow = self._connection.current_flow
        return flow is not None and flow.evicted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None
        connection = self._connection
        transport = scope.get(TRANSPORT_SCOPE_KEY)
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def evict() -> None:
            writer.cancel()

        connection.start(transport, evict)

        async def listen() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    self._close()
                    writer.cancel()
                    return

        listener = asyncio.create_task(listen())
        loop = asyncio.get_running_loop()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data, num_tokens in self._events:
                started = loop.time()
                flow = connection.current_flow
                if flow is not None:
                    flow.sending = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if self._on_send_blocked is not None:
                    self._on_send_blocked(loop.time() - started)
                flow = connection.current_flow  # a newer connection may have taken over
                if flow is not None:
                    flow.sending = False
                    flow.record_write(len(data) + _chunk_framing_bytes(len(data)), num_tokens)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (self.disconnected or self._evicted()):
                raise
            writer.uncancel()  # our own cancel (disconnect or eviction): finish normally
            if self._evicted():
                self._write_eviction(transport)
        except OSError:
            self.disconnected = True
        finally:
            # Always: a stream that ends for any reason must not stay bound to this socket.
            self._close()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()

    def _write_eviction(self, transport: Any) -> None:
        """Past the blocked ``send``: a final error event, the last chunk, then close."""
        eviction_event = self._connection.eviction_event
        if transport is None or transport.is_closing() or eviction_event is None:
            return
        body = eviction_event() + DONE
        transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        transport.close()
        # A reader that never reads would keep the closing transport forever.
        asyncio.get_running_loop().call_later(2.0, transport.abort)
