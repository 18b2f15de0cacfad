"""A streaming HTTP client on a raw socket, for real slow reading.

A slow reader must be slow at the socket: a small receive buffer and paced ``recv``
calls, so the server's kernel send queue really fills.  Sleeping between reads of an
already-buffered body (what most HTTP clients would do) measures nothing.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import h11
import orjson


@dataclass
class SSEEvent:
    """One SSE event, normalised: ``data`` is ``b"data: <payload>"`` (or the comment line
    for a comment-only event); ``event_id`` is its ``id:`` field, if any."""

    data: bytes
    received_at: float
    event_id: str | None = None


def parse_event(raw: bytes, received_at: float) -> SSEEvent:
    """Fold an event's ``id:``/``data:`` lines (SSE allows several) into one record."""
    lines = raw.split(b"\n")
    data_lines = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
    event_id = next((ln[3:].strip().decode() for ln in lines if ln.startswith(b"id:")), None)
    if not data_lines:
        return SSEEvent(raw, received_at, event_id)
    return SSEEvent(b"data: " + b"\n".join(data_lines), received_at, event_id)


@dataclass
class RawStream:
    """One SSE response read off a raw socket, event by event."""

    sock: socket.socket
    conn: h11.Connection
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    _buffer: bytes = b""
    _ended: bool = False

    def _pump(self, max_bytes: int) -> bool:
        """Read up to ``max_bytes`` from the socket into h11; False at end of body."""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = self.sock.recv(max_bytes)
                self.conn.receive_data(data)
                if not data:
                    return False
                continue
            if isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode(): v.decode() for k, v in event.headers}
                continue
            if isinstance(event, h11.Data):
                self._buffer += bytes(event.data)
                return True
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return False

    def read_headers(self) -> None:
        while self.status == 0:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(4096))
            elif isinstance(event, h11.Response):
                self.status = event.status_code
                self.headers = {k.decode(): v.decode() for k, v in event.headers}

    def events(self, max_read_bytes: int = 65536) -> Iterator[SSEEvent]:
        """SSE events (``data:`` payloads and ``:`` comments), as they arrive."""
        while True:
            while b"\n\n" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\n\n", 1)
                yield parse_event(raw, time.monotonic())
            if self._ended or not self._pump(max_read_bytes):
                self._ended = True
                if self._buffer:
                    yield parse_event(self._buffer, time.monotonic())
                    self._buffer = b""
                return

    def close(self) -> None:
        self.sock.close()


def open_stream(
    host: str,
    port: int,
    path: str,
    body: dict[str, object],
    *,
    receive_buffer_bytes: int | None = None,
    headers: dict[str, str] | None = None,
    timeout_seconds: float = 60.0,
) -> RawStream:
    """POST ``body`` and return the open response stream (headers read)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer_bytes is not None:
        # Before connect, so the TCP window is negotiated small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.settimeout(timeout_seconds)
    sock.connect((host, port))
    payload = orjson.dumps(body)
    conn = h11.Connection(h11.CLIENT)
    request_headers = [
        ("host", f"{host}:{port}"),
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
        ("accept", "text/event-stream"),
        *((headers or {}).items()),
    ]
    sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=request_headers)))
    sock.sendall(conn.send(h11.Data(data=payload)))
    sock.sendall(conn.send(h11.EndOfMessage()))
    stream = RawStream(sock, conn)
    stream.read_headers()
    return stream


def event_text(event: SSEEvent) -> str | None:
    """The text delta of a chat or completion chunk event; None for other events."""
    if not event.data.startswith(b"data: {"):
        return None
    payload = orjson.loads(event.data[6:])
    choices = payload.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")
