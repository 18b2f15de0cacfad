"""Client connections: header, body and idle deadlines, a cap, and protocol errors in
OpenAI's shape.

uvicorn closes connections idle between requests (``timeout_keep_alive``) but has no
deadline for a request's headers or body and no cap on connections, so sockets that
send nothing, drip their headers or send less body than their ``Content-Length`` stay
open for ever, and enough of them exhaust the process's file descriptors (then nothing
is accepted, ``/health`` included).  :class:`GuardedHttpProtocol` is uvicorn's httptools
protocol with what it lacks:

* **header deadline**: a request's line and headers must arrive within
  ``header_timeout_seconds`` of the connection opening (or of the previous response);
  else the connection is closed (with a 408 if part of a request came).  Headers past
  ``max_header_bytes`` get 431.
* **body deadline**: the body must arrive within ``body_timeout_seconds`` of the
  headers; else 408 and the connection is closed (the app sees a disconnect).
* **connection cap**: at ``max_connections`` open connections (HTTP and WebSocket), a
  new connection closes the oldest one that has no request in flight (silent or
  dripping sockets, idle keep-alive ones); if every connection is busy, the newcomer
  gets 503 and is closed.  Accepting never runs the process out of file descriptors.

Every error written here is JSON in OpenAI's shape, like the app's.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from sluicegate.errors import APIError

logger = logging.getLogger("sluicegate.connections")

#: File descriptors kept for everything but client sockets: the listening socket, logs,
#: the job journal, the store's connections, the event loop's own.
RESERVED_FILE_DESCRIPTORS = 128
#: The default cap never exceeds this, however high the open-file limit.
MAX_DEFAULT_CONNECTIONS = 8192
#: After an error answer, what the client still sends is read and dropped for this long
#: before the socket is closed: closing with unread data would reset the connection and
#: could destroy the answer before the client reads it.
LINGER_SECONDS = 1.0


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    max_header_bytes: int = 65536


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; the soft limit now.

    The usual soft limit (1,024) is kept low for programs that use ``select()``; an
    event loop on epoll has no such need.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(open_file_limit: int) -> int:
    """The cap that keeps ``RESERVED_FILE_DESCRIPTORS`` free (at least 16 connections)."""
    if open_file_limit == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, open_file_limit - RESERVED_FILE_DESCRIPTORS))


class ConnectionGuard:
    """The cap, shared by one server's connections, and those that may be closed for room.

    ``idle`` holds the connections with no request in flight, oldest first.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.idle: OrderedDict[GuardedHttpProtocol, None] = OrderedDict()
        self.num_evicted = 0
        self.num_refused = 0
        self.num_timed_out = 0
        self._warned_at = -float("inf")

    def set_idle(self, connection: GuardedHttpProtocol, idle: bool, *, first: bool = False) -> None:
        """Mark ``connection`` idle (evictable; ``first``: before every other) or busy."""
        self.idle.pop(connection, None)
        if idle:
            self.idle[connection] = None
            if first:
                self.idle.move_to_end(connection, last=False)

    def refused(self, num_open: int) -> None:
        """Count a refused newcomer; say so in the log at most every 10 seconds."""
        self.num_refused += 1
        now = time.monotonic()
        if now - self._warned_at >= 10.0:
            self._warned_at = now
            logger.warning(
                "refusing connections: %d open, every one busy (max_connections); %d "
                "refused so far",
                num_open,
                self.num_refused,
            )

    def make_room(self, newcomer: GuardedHttpProtocol) -> bool:
        """Close the oldest idle connection other than ``newcomer``; False if none."""
        for victim in self.idle:
            if victim is not newcomer:
                self.idle.pop(victim)
                self.num_evicted += 1
                victim.transport.close()
                return True
        return False


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines and the cap (see the module docstring).

    :func:`guarded_protocol` makes the class of one server, bound to its guard.
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        #: No request's headers are complete: counting header bytes, header deadline.
        self._waiting_for_headers = True
        self._header_bytes = 0
        #: The latest request has been received whole (its body too).
        self._message_done = True
        #: An error was answered: input is dropped until the socket closes.
        self._lingering = False

    # --- the connection ---

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if len(self.connections) > guard.limits.max_connections and not guard.make_room(self):
            guard.refused(len(self.connections) - 1)
            self._reply_and_close(
                APIError(
                    503,
                    "The server has too many open connections; retry shortly.",
                    code="too_many_connections",
                    headers={"retry-after": "1"},
                )
            )
            return
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.guard.set_idle(self, False)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        # Counted only while a request's headers are awaited from the start of this chunk
        # to its end (a chunk may end one request's body and begin the next request).
        was_waiting = self._waiting_for_headers
        super().data_received(data)
        if was_waiting and self._waiting_for_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.guard.limits.max_header_bytes:
                self._reply_and_close(
                    APIError(
                        431,
                        "The request line and headers exceed the limit of "
                        f"{self.guard.limits.max_header_bytes} bytes (max_header_bytes).",
                        code="headers_too_large",
                    )
                )

    def send_400_response(self, msg: str) -> None:
        self._reply_and_close(APIError(400, f"Malformed HTTP request: {msg}", code="bad_request"))

    def handle_websocket_upgrade(self) -> None:
        # This protocol hands the transport to the WebSocket one (its own timeouts apply).
        self._cancel_deadline()
        self.guard.set_idle(self, False)
        super().handle_websocket_upgrade()

    # --- a request's parts ---

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_done = False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._waiting_for_headers = False
        self._header_bytes = 0
        self.guard.set_idle(self, False)
        self._cancel_deadline()
        if not self.pipeline:  # a pipelined request's body is read after its turn comes
            self._arm(self.guard.limits.body_timeout_seconds, self._body_timed_out)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._message_done = True
        self._cancel_deadline()
        if self.cycle is not None and self.cycle.response_complete:
            self._await_request()  # answered before its body ended (413, 429): next one

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            if self._message_done:
                self._await_request()
            else:  # the rest of an unread body is still due (its deadline runs on)
                self.guard.set_idle(self, True)
        elif not self._message_done:  # a pipelined request has started: its body is due
            self._arm(self.guard.limits.body_timeout_seconds, self._body_timed_out)

    # --- deadlines ---

    def _await_request(self) -> None:
        self._waiting_for_headers = True
        self._header_bytes = 0
        self.guard.set_idle(self, True)
        self._arm(self.guard.limits.header_timeout_seconds, self._header_timed_out)

    def _arm(self, seconds: float, callback: Any) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, callback)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timed_out(self) -> None:
        self._deadline = None
        if not self._waiting_for_headers or self.transport.is_closing():
            return
        self.guard.num_timed_out += 1
        logger.debug("closing %s: no complete request headers in time", self.client)
        if self._header_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        seconds = self.guard.limits.header_timeout_seconds
        self._reply_and_close(
            APIError(
                408,
                f"The request headers did not arrive within {seconds:g}s (header_timeout_seconds).",
                code="request_timeout",
            )
        )

    def _body_timed_out(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if self._message_done or self.transport.is_closing():
            return
        self.guard.num_timed_out += 1
        logger.debug("closing %s: request body not received in time", self.client)
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        # The app now sees a disconnect, and whatever it sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        seconds = self.guard.limits.body_timeout_seconds
        self._reply_and_close(
            APIError(
                408,
                f"The request body did not arrive within {seconds:g}s of its headers "
                "(body_timeout_seconds).",
                code="request_timeout",
            )
        )

    def _reply_and_close(self, error: APIError) -> None:
        """Answer ``error``, then close once the client has had time to read it."""
        if self._lingering:
            return
        body = orjson.dumps(error.body())
        head = [STATUS_LINE[error.status_code]]
        headers = {
            **error.headers,
            "content-type": "application/json",
            "content-length": str(len(body)),
            "connection": "close",
        }
        head += [f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items()]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self.guard.set_idle(self, True, first=True)  # the first to go if room is needed
        self._arm(LINGER_SECONDS, self.transport.close)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedHttpProtocol]:
    """The protocol class of one server, bound to ``guard``."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": guard})
