"""Flow control: a slow reader pauses only its own sequence.

For each stream we count the tokens the client has not yet *received*: tokens still in
the stream's buffer, plus tokens written to the socket whose bytes are still in the
transport's buffer or the kernel's send queue (``ioctl(SIOCOUTQ)``: bytes not yet
acknowledged by the peer).  Counting only what we have not yet written would notice a
slow reader megabytes too late (see DESIGN.md, "Seeing a slow reader early").

At ``high_water_tokens`` flow control asks for the sequence to be paused (the scheduler
skips it; it keeps its KV cache until the scheduler decides to free it); at
``low_water_tokens`` it asks for it to be resumed.  The core running the sequence owns
the pause state (``Request.pause``): flow control reads it and asks, and asking twice is
harmless.
When the client accepts no bytes for ``stall_timeout_seconds``, the stream is evicted.

A client with a backlog takes tokens in as fast as its reader reads, so that rate is
its reader's pace: measured over windows of ``PACE_WINDOW_SECONDS`` while at least
``PACE_BACKLOG_TOKENS`` wait, and kept on the request (``measured_tokens_per_second``)
for QoE and pace-aware scheduling.  A client with no backlog shows no pace.

A resumable stream outlives its connection: while no client is attached
(:meth:`StreamFlow.detach`) nothing is received, so its backlog grows to the high-water
mark and the sequence pauses like any slow reader's; a client that reattaches
(:meth:`StreamFlow.attach`) starts from the tokens it says it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import struct
import termios
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluicegate.engine.output import RequestStream
from sluicegate.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_SIOCOUTQ = termios.TIOCOUTQ  # same request number on Linux

#: A reader's pace is measured while at least this many tokens wait for it ...
PACE_BACKLOG_TOKENS = 16
#: ... over windows of at least this long (then smoothed: half the old, half the new).
PACE_WINDOW_SECONDS = 2.0


def unsent_socket_bytes(transport: Any) -> int:
    """Bytes in the transport buffer plus the kernel send queue (not yet acked)."""
    buffered = 0
    with contextlib.suppress(Exception):
        buffered = int(transport.get_write_buffer_size())
    sock = transport.get_extra_info("socket")
    if sock is None:
        return buffered
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # closed socket (fileno -1) or not a TCP socket
        return buffered
    return buffered + int(struct.unpack("i", raw)[0])


@dataclass(slots=True, frozen=True)
class FlowConfig:
    enabled: bool = True
    high_water_tokens: int = 128
    low_water_tokens: int = 32
    high_water_bytes: int = 65536
    stall_timeout_seconds: float = 30.0
    check_interval_seconds: float = 0.02


class FlowActions(Protocol):
    """What flow control asks of the engine side."""

    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def evict(self, request_id: str) -> None: ...


@dataclass(slots=True)
class StreamFlow:
    """One stream's delivery accounting.  Written by its writer, read by the controller."""

    stream: RequestStream
    #: The core's request (its pause is read here, never written; its reader's measured
    #: pace is written here only).
    request: Request
    transport: Any = None
    #: (cumulative socket bytes, cumulative tokens) at the end of each write.
    writes: deque[tuple[int, int]] = field(default_factory=deque)
    bytes_written: int = 0
    tokens_written: int = 0
    tokens_received: int = 0
    last_progress_time: float = field(default_factory=time.monotonic)
    last_acked_bytes: int = 0
    sending: bool = False
    evicted: bool = False
    on_evict: Callable[[], None] | None = None
    #: WebSocket credit flow: tokens the client has allowed in total (None: byte-based).
    credit_tokens: int | None = None
    #: No client connected (a resumable stream between connections): nothing is received.
    detached: bool = False
    #: Bumped by every attach, so a writer of an earlier connection stops counting.
    attachment: int = 0
    #: (time, tokens received) when the current pace window opened (None: no backlog).
    pace_mark: tuple[float, int] | None = None
    #: A pipeline's head, where the engine writes (None: the engine writes ``stream``):
    #: tokens held in the stages between it and ``stream`` are not received either.
    source: RequestStream | None = None
    #: Where a pipeline's backlog is held (a stage's name, or ``client``).
    holdup: Callable[[], str] | None = None
    #: Flow control asked for a pause and not yet for a resume (the core pauses later).
    pause_asked: bool = False
    #: The other choices' sequences of an answer of ``n`` choices (read like ``request``).
    siblings: tuple[Request, ...] = ()

    @property
    def produced(self) -> RequestStream:
        """The stream the engine writes."""
        return self.stream if self.source is None else self.source

    def stage(self) -> str:
        """Who holds the backlog: ``client`` (the reader), or a pipeline stage."""
        return "client" if self.holdup is None else self.holdup()

    def attach(self, tokens_received: int) -> int:
        """A client (re)connected holding ``tokens_received`` tokens; returns its attachment.

        Byte accounting restarts for the new connection; token accounting continues from
        what the client already has.
        """
        self.attachment += 1
        self.detached = False
        self.transport = None
        self.writes.clear()
        self.bytes_written = 0
        self.last_acked_bytes = 0
        self.tokens_written = tokens_received
        self.tokens_received = tokens_received
        self.sending = False
        self.last_progress_time = time.monotonic()
        self.pace_mark = None
        return self.attachment

    def detach(self) -> None:
        """The client went away: what was written but not acknowledged was not received."""
        self.attachment += 1
        self.detached = True
        self.transport = None
        self.writes.clear()
        self.sending = False

    @property
    def paused(self) -> bool:
        """The core has paused this stream's sequence (one of them, for ``n`` choices:
        a choice that ended is never paused, and the others may run on)."""
        return self.request.pause.paused or any(r.pause.paused for r in self.siblings)

    @property
    def credit_available(self) -> int:
        """Tokens that may still be sent under the client's credit."""
        assert self.credit_tokens is not None
        return self.credit_tokens - self.tokens_written

    def record_write(self, num_bytes: int, num_tokens: int) -> None:
        self.bytes_written += num_bytes
        self.tokens_written += num_tokens
        self.writes.append((self.bytes_written, self.tokens_written))

    def refresh_received(self) -> int:
        """Update and return the tokens whose bytes the peer has acknowledged."""
        if self.detached:
            return self.tokens_received
        if self.transport is None:
            acked = self.bytes_written
        else:
            acked = self.bytes_written - unsent_socket_bytes(self.transport)
        if acked > self.last_acked_bytes:
            self.last_acked_bytes = acked
            self.last_progress_time = time.monotonic()
        while self.writes and self.writes[0][0] <= acked:
            self.tokens_received = self.writes.popleft()[1]
        return self.tokens_received

    def measure_pace(self, now: float) -> None:
        """While a backlog waits for its client, how fast the client takes tokens in is
        its reader's pace (see the module's docstring)."""
        if self.detached or self.unreceived_tokens < PACE_BACKLOG_TOKENS:
            self.pace_mark = None
            return
        if self.pace_mark is None:
            self.pace_mark = (now, self.tokens_received)
            return
        since, received = self.pace_mark
        if now - since < PACE_WINDOW_SECONDS:
            return
        rate = (self.tokens_received - received) / (now - since)
        self.pace_mark = (now, self.tokens_received)
        if rate <= 0:
            return  # a stalled reader: the stall timeout's business, not a pace
        old = self.request.pace.measured_tokens_per_second
        self.request.pace.measured_tokens_per_second = rate if old is None else (old + rate) / 2

    @property
    def unreceived_tokens(self) -> int:
        return self.produced.total_tokens - self.tokens_received

    @property
    def waiting_on_client(self) -> bool:
        """Something is produced that the client has not taken (never while detached: a
        stream without a client is governed by its detach grace, not the stall timeout)."""
        if self.detached:
            return False
        return self.stream.pending_tokens > 0 or self.last_acked_bytes < self.bytes_written


class FlowController:
    """Watches every live stream; pauses, resumes, preempts and evicts."""

    def __init__(
        self,
        config: FlowConfig,
        actions: FlowActions,
        on_pause: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.actions = actions
        #: Told the stage that held the backlog of each pause it asks for.
        self.on_pause = on_pause
        self._flows: dict[str, StreamFlow] = {}
        #: Set while a stream is registered: the monitor polls only then.
        self._watching = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_paused(self) -> int:
        return sum(1 for f in self._flows.values() if f.paused)

    def paused_by_stage(self) -> dict[str, int]:
        """Paused streams by where their backlog is held (only stages with any)."""
        out: dict[str, int] = {}
        for flow in self._flows.values():
            if flow.paused:
                stage = flow.stage()
                out[stage] = out.get(stage, 0) + 1
        return out

    def snapshot(self, limit: int | None = 20) -> list[dict[str, object]]:
        """The streams furthest behind (``limit`` of them; None: all), with their request
        ids, for ``/v1/stats`` (which shows each caller only what it may see)."""
        flows = sorted(self._flows.values(), key=lambda f: f.unreceived_tokens, reverse=True)
        return [
            {
                "request_id": f.stream.request_id,
                "unreceived_tokens": f.unreceived_tokens,
                "buffered_tokens": f.stream.pending_tokens,
                "buffered_bytes": f.stream.pending_bytes,
                "tokens_produced": f.stream.total_tokens,
                "tokens_written": f.tokens_written,
                "tokens_received": f.tokens_received,
                "bytes_written": f.bytes_written,
                "bytes_acked": f.last_acked_bytes,
                "sending": f.sending,
                "paused": f.paused,
                "preempted": f.request.status == RequestStatus.PREEMPTED,
                "reader_tokens_per_second": _rounded(f.request.pace.measured_tokens_per_second),
                "yielding": f.request.pace.yielding,
                "held_by": f.stage(),
            }
            for f in flows[:limit]
        ]

    def register(self, flow: StreamFlow) -> None:
        self._flows[flow.stream.request_id] = flow
        self._watching.set()
        flow.produced.on_put = lambda _stream: self.check(flow)

    def unregister(self, request_id: str) -> None:
        flow = self._flows.pop(request_id, None)
        if flow is not None:
            flow.produced.on_put = None
            if flow.paused and not flow.produced.finished:
                self.actions.resume(request_id)  # nobody will ask any more

    def start(self) -> None:
        self._task = asyncio.create_task(self._monitor(), name="sluicegate-flow-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check(self, flow: StreamFlow, now: float | None = None) -> None:
        """Apply the water marks and stall eviction to one stream."""
        if flow.evicted:
            return
        now = time.monotonic() if now is None else now
        cfg = self.config
        flow.refresh_received()
        flow.measure_pace(now)
        if (
            cfg.stall_timeout_seconds > 0
            and flow.waiting_on_client
            and now - flow.last_progress_time > cfg.stall_timeout_seconds
        ):
            self._evict(flow)
            return
        request_id = flow.stream.request_id
        if not cfg.enabled or flow.produced.finished:
            if flow.paused:
                self.actions.resume(request_id)
            return
        if flow.credit_tokens is not None:
            # Credit flow: pause once what is buffered already uses up the credit.
            behind = flow.credit_available - flow.stream.pending_tokens <= 0
            caught_up = not behind
        else:
            backlog = flow.unreceived_tokens
            pending_bytes = flow.stream.pending_bytes
            behind = backlog >= cfg.high_water_tokens or pending_bytes >= cfg.high_water_bytes
            caught_up = backlog <= cfg.low_water_tokens and pending_bytes < cfg.high_water_bytes
        if behind and not flow.paused:
            self.actions.pause(request_id)
            if not flow.pause_asked and self.on_pause is not None:
                self.on_pause(flow.stage())
            flow.pause_asked = True
        elif caught_up and flow.paused:
            self.actions.resume(request_id)
            flow.pause_asked = False

    def _evict(self, flow: StreamFlow) -> None:
        flow.evicted = True
        self.actions.evict(flow.stream.request_id)
        if flow.on_evict is not None:
            flow.on_evict()

    async def _monitor(self) -> None:
        # A reader that catches up gives no event (the kernel drains its queue silently),
        # so paused and lagging streams are polled.
        while True:
            if not self._flows:  # nothing to watch: no wake-ups (an idle server sleeps)
                self._watching.clear()
                await self._watching.wait()
            await asyncio.sleep(self.config.check_interval_seconds)
            now = time.monotonic()
            for flow in list(self._flows.values()):
                if flow.paused or flow.waiting_on_client:
                    try:
                        self.check(flow, now)
                    except Exception:  # one broken stream must not stop the monitor
                        logger.exception("flow check failed for %s", flow.stream.request_id)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
