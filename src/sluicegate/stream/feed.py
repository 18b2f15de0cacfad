"""What passes from a stream's producer to the connection attached to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

#: Events a connection's feed holds before the producer waits for its writer.  Two, not
#: one: the hop from producer to writer must not make a fast reader's events coalesce.
FEED_MAX_WAITING = 2


@dataclass(slots=True)
class FeedItem:
    data: bytes
    seq: int | None
    num_tokens: int
    comment: str | None = None


class Feed:
    """Events for one attached connection, from the producer to the writer, in order."""

    def __init__(self, watermark: int, attachment: int, on_empty: asyncio.Event) -> None:
        #: Events up to this seq were logged before the attach: the writer replays them.
        self.watermark = watermark
        self.attachment = attachment
        self.items: deque[FeedItem] = deque()
        self.closed = False
        self._changed = asyncio.Event()
        self._on_empty = on_empty

    @property
    def exhausted(self) -> bool:
        return self.closed and not self.items

    def push(self, item: FeedItem) -> None:
        if not self.closed:
            self.items.append(item)
            self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def next(self, heartbeat_seconds: float) -> FeedItem | None:
        """The next event; ``None`` when a heartbeat is due (or the feed is exhausted)."""
        if not self.items:
            self._on_empty.set()
            if self.closed:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat_seconds):
                    await self._changed.wait()
            if not self.items:
                return None
        item = self.items.popleft()
        if len(self.items) < FEED_MAX_WAITING:
            self._on_empty.set()
        return item


@dataclass(slots=True)
class Emission:
    """One write of the producer: whole SSE messages, the tokens they carry, and the
    output tokens whose text they complete (logged with them)."""

    data: bytes
    num_tokens: int = 0
    committed_token_ids: list[int] = field(default_factory=list)
    logged: bool = True
    final: bool = False
    comment: str | None = None
