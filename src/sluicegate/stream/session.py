"""Resumable streams: one stream's production on this replica, its replay log, and the
connections that read it.

A streamed request becomes a :class:`StreamSession`.  Its *producer* task turns the
engine's output into SSE events, appends each to the stream's replay log in the store
(the store numbers them: the SSE id is ``<stream-id>:<seq>``), and hands it to the
connection attached at the moment, if any.  A connection's writer first replays from the
log what its client missed, then writes live events.  So connections come and go:

* A client that disconnects leaves the session *detached*: it goes on generating and
  logging, until flow control pauses it at the high-water mark (nothing is received),
  for ``detached_grace_seconds``.  A client that resumes in time attaches and loses
  nothing.
* After the grace, or at a drain's deadline, the sequence is stopped and the stream
  *checkpointed*: its log holds every event with the token ids they contain, its status
  says so, its lease is released, and any replica can continue it.
* A replica generates a stream only while it holds the stream's lease in the store,
  renewed while it generates; appends are fenced by it, so two replicas never write one
  log.  A replica that dies stops renewing, and another takes over when it expires.

Exactly once, across replicas: each event is logged atomically with exactly the token
ids whose text it completes (the text assembler releases text only at clean token
boundaries), so a replica that takes over re-prefills prompt + those tokens with the same
sampling state and regenerates, identically, whatever was never logged.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from sluicegate.engine.output import FlushPolicy, RequestOutput
from sluicegate.service.generation import Generation, Life
from sluicegate.service.service import Service
from sluicegate.store.base import Store
from sluicegate.store.errors import LeaseLost, ReplayTrimmed, StoreError, StoreUnavailable
from sluicegate.store.event_id import format_event_id
from sluicegate.store.records import StreamStatus
from sluicegate.stream.events import (
    StreamFormat,
    drain_notice,
    error_event,
    moved_notice,
    replay_error,
    stall_error,
    superseded_notice,
)
from sluicegate.stream.feed import FEED_MAX_WAITING, Emission, Feed, FeedItem
from sluicegate.stream.fenced_log import FencedLog
from sluicegate.stream.flow import FlowController, StreamFlow
from sluicegate.stream.log_reads import REPLAY_BATCH_EVENTS, Transform
from sluicegate.stream.response_events import ResponseEvents
from sluicegate.stream.sse import DONE, EventStreamResponse, SSEConnection, sse_data, with_event_id
from sluicegate.stream.writer import ChunkWriter, Frame

logger = logging.getLogger(__name__)

#: Why a session stopped generating without finishing its stream.
StopReason = Literal["draining", "detached", "lease_lost", "evicted", "store_unavailable"]

#: Why a stream was checkpointed (the ``streams_checkpointed_total{reason}`` label values).
CHECKPOINT_REASONS = ("draining", "detached", "degraded_log")


@dataclass(slots=True)
class SessionContext:
    """What every stream session of this replica shares."""

    service: Service
    store: Store
    flow: FlowController
    flush_policy: FlushPolicy
    #: A stream whose client left keeps generating this long (a quick reconnect loses nothing).
    detached_grace_seconds: float
    #: This process's identity in the store's leases.
    owner: str
    #: How long a lease lasts unrenewed (renewed at a third of it).
    lease_ttl: float
    #: This replica's live sessions, by stream id.
    sessions: dict[str, StreamSession] = field(default_factory=dict)


class StreamSession:
    """One resumable stream produced on this replica.  Owned by the event loop."""

    def __init__(
        self,
        context: SessionContext,
        generation: Generation,
        tenant_name: str,
        fmt: StreamFormat,
        *,
        first_chunk: bytes | None,
        last_seq: int = 0,
        responses: ResponseEvents | None = None,
    ) -> None:
        self.context = context
        self.service = context.service
        self.store = context.store
        self.generation = generation
        generation.resumable = True
        self.stream_id = generation.request_id
        #: Its log, written under the lease (``fenced_log.py``).
        self.log = FencedLog(
            context.store,
            self.stream_id,
            context.owner,
            context.lease_ttl,
            context.service.metrics.stream_leases_reclaimed_total,
        )
        self.tenant_name = tenant_name
        self.format = fmt
        #: A Responses API stream: its events are made from the chat chunks (``responses``:
        #: the state rebuilt from the log, at a takeover).
        self.responses = responses
        if fmt.response is not None and responses is None:
            self.responses = ResponseEvents(fmt.response["template"])
            first_chunk = self.responses.opening()
        #: A background response runs to its end whether or not anybody reads it: its log
        #: is its reader (no pause for an absent client, no detach grace).
        self.background = self.responses is not None and bool(
            self.responses.template.get("background")
        )
        self.flow = StreamFlow(generation.stream, generation.request, siblings=generation.siblings)
        if (chain := generation.chain) is not None:
            self.flow.source, self.flow.holdup = chain.head, chain.holdup
        context.flow.register(self.flow)
        if self.background:
            self.flow.detach()
        self.feed: Feed | None = None
        #: Seq of the last event this replica logged (or found logged, at a takeover).
        self.last_seq = last_seq
        #: (seq, tokens carried by events up to it): what a client at a seq has received.
        self._tokens_through: list[tuple[int, int]] = []
        self._tokens_emitted = 0
        #: False once an append failed: the log stays a consistent prefix of the stream.
        self.logging = True
        self.log_finished = False
        self._compiled_from = generation.request.reuse.compiled_from  # as stored
        self.stop_reason: StopReason | None = None
        self.done = False
        self._writer_back = asyncio.Event()
        self._grace: asyncio.TimerHandle | None = None
        context.sessions[self.stream_id] = self
        self._task = asyncio.create_task(
            self._produce(first_chunk), name=f"sluicegate-stream-{self.stream_id}"
        )

    # --- connections ---

    def attach(self, after_seq: int) -> Feed:
        """A client connects holding the events up to ``after_seq``; returns its feed.

        Replaces any connection attached before, which is told so in a final error event
        (``stream_superseded``) after what it already has: it never just goes quiet.
        Events logged so far (up to the feed's watermark) come from the log; every later
        one through the feed, so none is missed or repeated.
        """
        if self.feed is not None:
            self.feed.push(FeedItem(superseded_notice(self.stream_id), None, 0))
            self.feed.close()
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        attachment = self.flow.attach(self.tokens_through(after_seq))
        self.feed = Feed(self.last_seq, attachment, self._writer_back)
        self._writer_back.set()
        return self.feed

    def detach(self, feed: Feed) -> None:
        """``feed``'s connection closed; from now on the stream is detached (if current)."""
        if self.feed is not feed:
            return
        self.feed = None
        feed.close()
        self.flow.detach()
        self._writer_back.set()
        if self.done:
            self.context.flow.unregister(self.stream_id)
        elif self.stop_reason is None and not self.generation.ended and not self.background:
            grace = self.context.detached_grace_seconds
            self._grace = asyncio.get_running_loop().call_later(grace, self._grace_expired)

    def tokens_through(self, seq: int) -> int:
        """Tokens carried by this session's events up to ``seq``."""
        index = bisect.bisect_right(self._tokens_through, (seq, 1 << 62))
        return self._tokens_through[index - 1][1] if index else 0

    def response(
        self, after_seq: int, headers: dict[str, str], transform: Transform | None = None
    ) -> EventStreamResponse:
        """Attach a new connection and stream to it from ``after_seq`` (``transform``: what
        the events pass through on their way, such as a Responses cursor's filter)."""
        feed = self.attach(after_seq)
        connection = SSEConnection()
        events = self.events(feed, connection, after_seq)
        return EventStreamResponse(
            events if transform is None else transform(events),
            connection,
            headers=headers,
            on_send_blocked=self.service.metrics.stream_send_blocked_seconds.observe,
        )

    async def events(
        self, feed: Feed, connection: SSEConnection, after_seq: int
    ) -> AsyncIterator[tuple[bytes, int]]:
        """What one attached connection writes: the missed events, then live ones."""
        connection.bind(self.flow, feed.attachment, lambda: self.detach(feed), self.eviction_event)
        position = after_seq
        before = self.tokens_through(after_seq)
        try:
            while position < feed.watermark:
                result = await self.store.read(self.stream_id, position, limit=REPLAY_BATCH_EVENTS)
                if result.trimmed:
                    raise ReplayTrimmed(self.stream_id, position, result.resumable_from_seq)
                events = [e for e in result.events if e.seq <= feed.watermark]
                if not events:
                    break
                for event in events:
                    through = self.tokens_through(event.seq)
                    connection.sent_event_id = True
                    yield (
                        with_event_id(event.data, format_event_id(self.stream_id, event.seq)),
                        through - before,
                    )
                    before = through
                    position = event.seq
        except StoreError as error:
            yield replay_error(error), 0
            return
        heartbeat = self.context.flush_policy.heartbeat_seconds
        while not feed.exhausted:
            item = await feed.next(heartbeat)
            if item is None:
                if not feed.exhausted:
                    yield connection.comment("keep-alive"), 0
                continue
            if item.comment is not None:
                yield connection.comment(item.comment), 0
            elif item.seq is not None:
                connection.sent_event_id = True
                event_id = format_event_id(self.stream_id, item.seq)
                yield with_event_id(item.data, event_id), item.num_tokens
            else:
                yield item.data, item.num_tokens

    def eviction_event(self) -> bytes:
        """The stalled client is cut off: what it is told (the log gets it too)."""
        if not self.generation.ended:
            self.stop_reason = "evicted"
        self.service.evicted(self.generation)
        return sse_data(stall_error(self.context.flow.config.stall_timeout_seconds))

    # --- stopping ---

    def stop(self, reason: StopReason, status: str) -> None:
        """Stop generating; the stream stays resumable from what was logged."""
        if self.done or self.generation.ended:
            return
        self.stop_reason = reason
        self.service.stop(self.generation, status)

    def _grace_expired(self) -> None:
        self._grace = None
        if self.feed is not None or self.done or self.generation.ended:
            return
        self.stop("detached", "cancelled")
        self.service.metrics.cancellations_total.inc()
        # Nobody reads it any more: not a paused stream, whatever is left to log.
        self.context.flow.unregister(self.stream_id)

    def lease_lost(self) -> None:
        """Another replica holds the lease now (we stalled past it): stop at once."""
        if self.stop_reason is None and not self.done:
            logger.warning("stream %s: generation lease lost; stopping", self.stream_id)
            self.stop("lease_lost", "moved")
            self.stop_reason = "lease_lost"

    async def wait_done(self) -> None:
        """Until the producer has ended; a cancellation of the caller reaches it (only
        the producer's own cancellation is not an error here)."""
        await asyncio.wait([self._task])

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    # --- the producer ---

    async def _produce(self, first_chunk: bytes | None) -> None:
        try:
            async for emission in self._emissions(first_chunk):
                if not await self._publish(emission) or emission.final:
                    break
                await self._wait_for_writer()
            await self._settle()
        except Exception:
            logger.exception("stream %s: producer failed", self.stream_id)
            self.service.cancel(self.generation)
        finally:
            self._ended()

    async def _wait_for_writer(self) -> None:
        """With a connection attached, take the next flush only while its writer keeps up
        (fewer than ``FEED_MAX_WAITING`` events wait for it): a slow socket lets output
        accumulate in the request's stream (coalesced, and seen by flow control), as if
        the writer pulled it directly."""
        while self.feed is not None and len(self.feed.items) >= FEED_MAX_WAITING:
            self._writer_back.clear()
            await self._writer_back.wait()

    async def _emissions(self, first_chunk: bytes | None) -> AsyncIterator[Emission]:
        service = self.service
        generation = self.generation
        stream = generation.stream
        policy = self.format.flush_policy(self.context.flush_policy)
        queued_policy = FlushPolicy(
            policy.interval_seconds, policy.max_tokens, min(1.0, policy.heartbeat_seconds)
        )
        if first_chunk is not None:
            yield Emission(first_chunk)
        writer = ChunkWriter(service, generation, self.format)
        #: Tokens of chunks that made no event yet (a Responses stream): they ride with the
        #: next one, so a takeover re-prefills exactly what the log's events carry.
        held, held_ids = 0, list[int]()
        while True:
            if generation.queued:
                # Queued: tell the client where it stands, once a second, until it starts.
                position, eta = service.position(generation)
                comment = f"queued position={position} eta_ms={eta * 1000:.0f}"
                yield Emission(b"", logged=False, comment=comment)
                output = await stream.next(queued_policy)
            else:
                output = await stream.next(policy)
            if output is None:
                continue  # heartbeats are the writer's
            frame = writer.write(output)
            self._observe_backlog()
            frame.num_tokens += held
            frame.committed_token_ids = held_ids + frame.committed_token_ids
            held, held_ids = 0, []
            if output.finished:
                for emission in self._last(writer, output, frame):
                    yield emission
                return
            if frame.chunk is not None:
                data = self._encode(frame.chunk)
                if not data:
                    held, held_ids = frame.num_tokens, frame.committed_token_ids
                    continue
                yield Emission(data, frame.num_tokens, frame.committed_token_ids)

    def _encode(self, chunk: dict[str, object]) -> bytes:
        """A chunk as this stream's events: itself, or a response's events."""
        return sse_data(chunk) if self.responses is None else self.responses.encode(chunk)

    def _observe_backlog(self) -> None:
        """Tokens not yet received by the client, and (a pipeline) in front of each stage."""
        flow = self.flow
        histogram = self.service.metrics.stream_buffer_tokens
        histogram.labels("client").observe(flow.stream.total_tokens - flow.tokens_received)
        if (chain := self.generation.chain) is not None:
            for stage, tokens in chain.backlog().items():
                histogram.labels(stage).observe(tokens)

    def _last(self, writer: ChunkWriter, output: RequestOutput, frame: Frame) -> list[Emission]:
        """The end of the stream: one logged event (so that a takeover never sees half of
        it), or, when stopped to stay resumable, the last text and an unlogged notice."""
        text = b"" if frame.chunk is None else self._encode(frame.chunk)
        num_tokens, committed = frame.num_tokens, frame.committed_token_ids
        responses = self.responses
        if self.generation.life is Life.STOPPED:
            emissions = [Emission(text, num_tokens, committed)] if text else []
            notice = self._notice()
            if notice is not None:
                emissions.append(Emission(notice, logged=False))
            return emissions
        if self.stop_reason == "evicted":
            stalled = stall_error(self.context.flow.config.stall_timeout_seconds)
            end = sse_data(stalled) if responses is None else responses.fail(stalled["error"])
            return [Emission(text + end + DONE, num_tokens, committed, final=True)]
        ending = writer.finish(output)
        if ending.error is not None:
            body = ending.error.event_body()
            end = sse_data(body) if responses is None else responses.fail(body["error"])
            return [Emission(text + end + DONE, num_tokens, committed, final=True)]
        if responses is not None:
            cancelled = self.generation.life is Life.CANCELLED
            end = responses.finish(ending.chunks, cancelled=cancelled)
            return [Emission(text + end + DONE, num_tokens, committed, final=True)]
        data = text + b"".join(sse_data(chunk) for chunk in ending.chunks)
        return [Emission(data + DONE, num_tokens, committed, final=True)]

    def _notice(self) -> bytes | None:
        """Why a stream stopped while a client may be reading it; None: nobody is."""
        if self.stop_reason == "detached":
            return None
        if self.stop_reason == "lease_lost":
            return moved_notice(self.stream_id)
        return sse_data(drain_notice(self.stream_id)) + DONE

    async def _publish(self, emission: Emission) -> bool:
        """Log an emission and hand it to the connection; False: stop producing."""
        seq: int | None = None
        if emission.logged and self.logging:
            try:
                await self._record_compiled_from()
                seq = await self.log.append(emission.data, emission.committed_token_ids)
            except LeaseLost:
                self.lease_lost()
                self._deliver(FeedItem(self._notice() or b"", None, 0))
                return False
            except StoreUnavailable as error:  # fail_closed: no stream without its log
                self.logging = False
                self.stop_reason = "store_unavailable"
                self.service.cancel(self.generation)
                message = f"The replay store is unreachable ({error}); the stream was stopped."
                self._deliver(FeedItem(error_event("store_unavailable", message), None, 0))
                return False
            except StoreError as error:  # expired (a very long pause) or closed
                logger.warning("stream %s: no longer logged: %s", self.stream_id, error)
                self.logging = False
            if seq is None and self.logging:
                # fail_open and the store is down: the log keeps what it has, a consistent
                # prefix; the rest is sent without ids (it cannot be resumed past).
                self.logging = False
        self._tokens_emitted += emission.num_tokens
        if self.background and self.feed is None:
            # Nobody reads a background response now: what is logged counts as received.
            self.flow.tokens_received = self.flow.tokens_written = self._tokens_emitted
        if seq is not None:
            self.last_seq = seq
            self._tokens_through.append((seq, self._tokens_emitted))
        if emission.comment is not None:
            self._deliver(FeedItem(b"", None, 0, emission.comment))
        elif emission.data:
            self._deliver(FeedItem(emission.data, seq, emission.num_tokens))
        if emission.final and seq is not None:
            try:
                await self.log.finish()
                self.log_finished = True
            except StoreError as error:
                logger.warning("stream %s: log not closed: %s", self.stream_id, error)
        return True

    async def _record_compiled_from(self) -> None:
        """Store ``Reuse.compiled_from`` before the tokens it concerns are logged."""
        if (value := self.generation.request.reuse.compiled_from) != self._compiled_from:
            await self.store.update_meta(self.stream_id, compiled_from=value)
            self._compiled_from = value

    def _deliver(self, item: FeedItem) -> None:
        if self.feed is not None:
            self.feed.push(item)

    async def _settle(self) -> None:
        """After the last event: close the lease, or checkpoint for another replica."""
        store = self.store
        owner = self.context.owner
        reason = self.stop_reason
        if reason == "lease_lost":
            return
        if not self.log_finished and reason != "store_unavailable":
            label = reason if reason in ("draining", "detached") else "degraded_log"
            try:
                await store.update_meta(self.stream_id, status=StreamStatus.CHECKPOINTED)
            except StoreError as error:
                logger.warning("stream %s: checkpoint not saved: %s", self.stream_id, error)
            self.service.metrics.streams_checkpointed_total.labels(label).inc()
            logger.info(
                "stream %s checkpointed (%s) after seq %d", self.stream_id, label, self.last_seq
            )
        await store.release_lease(self.stream_id, owner)

    def _ended(self) -> None:
        self.done = True
        if self.context.sessions.get(self.stream_id) is self:
            del self.context.sessions[self.stream_id]
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if self.feed is not None:
            self.feed.close()  # its writer ends after what it has; detach unregisters
        else:
            self.context.flow.unregister(self.stream_id)
