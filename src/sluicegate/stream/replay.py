"""Serving a stream from its log: replaying a finished one, following one another replica
generates (and taking it over as soon as that replica lets go)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sluicegate.admission.tenants import Tenant
from sluicegate.errors import APIError
from sluicegate.store.base import Store
from sluicegate.store.errors import ReplayTrimmed, StoreError
from sluicegate.store.event_id import format_event_id
from sluicegate.store.records import ReplayResult
from sluicegate.stream.events import error_event, replay_error
from sluicegate.stream.log_reads import REPLAY_BATCH_EVENTS
from sluicegate.stream.sessions import SessionRegistry
from sluicegate.stream.sse import SSEConnection, with_event_id

#: How often a follower looks for new events and for the lease to free up.
FOLLOW_POLL_SECONDS = 0.05


async def replay(
    store: Store,
    stream_id: str,
    after_seq: int,
    first: ReplayResult,
    connection: SSEConnection,
) -> AsyncIterator[tuple[bytes, int]]:
    """A finished stream's events after ``after_seq``, to its end."""
    result = first
    position = after_seq
    try:
        while True:
            for event in result.events:
                connection.sent_event_id = True
                yield with_event_id(event.data, format_event_id(stream_id, event.seq)), 0
                position = event.seq
            if position >= result.last_seq or not result.events:
                return
            result = await store.read(stream_id, position, limit=REPLAY_BATCH_EVENTS)
            if result.trimmed:
                raise ReplayTrimmed(stream_id, position, result.resumable_from_seq)
    except StoreError as error:
        yield replay_error(error), 0


async def follow(
    sessions: SessionRegistry,
    tenant: Tenant,
    stream_id: str,
    after_seq: int,
    connection: SSEConnection,
) -> AsyncIterator[tuple[bytes, int]]:
    """Relay a stream another replica generates, and take it over when that one stops."""
    store = sessions.store
    heartbeat_seconds = sessions.context.flush_policy.heartbeat_seconds
    position = after_seq
    heartbeat_at = asyncio.get_running_loop().time() + heartbeat_seconds
    try:
        while True:
            result = await store.read(stream_id, position, limit=REPLAY_BATCH_EVENTS)
            if result.trimmed:
                raise ReplayTrimmed(stream_id, position, result.resumable_from_seq)
            for event in result.events:
                connection.sent_event_id = True
                yield with_event_id(event.data, format_event_id(stream_id, event.seq)), 0
                position = event.seq
            if result.finished and position >= result.last_seq:
                return
            if result.events:
                continue
            if sessions.service.admission.draining:
                yield (
                    error_event(
                        "server_draining",
                        "The server is shutting down. Resume the stream with GET "
                        f"/v1/streams/{stream_id} (with Last-Event-ID) on another replica.",
                        stream_id=stream_id,
                    ),
                    0,
                )
                return
            session = sessions.get(stream_id)
            if session is None and await store.lease_owner(stream_id) is None:
                session = await sessions.take_over(tenant, stream_id)
            if session is not None and not session.done:
                feed = session.attach(position)
                async for item in session.events(feed, connection, position):
                    yield item
                return
            now = asyncio.get_running_loop().time()
            if now >= heartbeat_at:
                heartbeat_at = now + heartbeat_seconds
                yield connection.comment("keep-alive"), 0
            await asyncio.sleep(FOLLOW_POLL_SECONDS)
    except StoreError as error:
        yield replay_error(error), 0
    except APIError as error:  # it could not be taken over here (limits, model)
        yield error_event(error.code or "resume_failed", error.message, stream_id=stream_id), 0
