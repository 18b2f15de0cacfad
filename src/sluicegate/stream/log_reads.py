"""Reading a stream's replay log: in batches, whole, and what a connection's events may
pass through on their way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sluicegate.store.base import Store
from sluicegate.store.errors import ReplayTrimmed

#: What a connection's events may pass through on their way (data, tokens carried).
Transform = Callable[[AsyncIterator[tuple[bytes, int]]], AsyncIterator[tuple[bytes, int]]]

#: Events per store read while replaying.
REPLAY_BATCH_EVENTS = 256


async def read_all(store: Store, stream_id: str) -> list[bytes]:
    """Every logged event's data, in order (a log is at most ``replay_max_events`` long);
    raises :class:`ReplayTrimmed` if its start is gone."""
    entries: list[bytes] = []
    position = 0
    while True:
        result = await store.read(stream_id, position, limit=REPLAY_BATCH_EVENTS)
        if result.trimmed:
            raise ReplayTrimmed(stream_id, position, result.resumable_from_seq)
        entries.extend(event.data for event in result.events)
        if not result.events or result.events[-1].seq >= result.last_seq:
            return entries
        position = result.events[-1].seq
