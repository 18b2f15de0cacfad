"""A stream's log as its generating replica writes it: every write fenced by the lease.

A write refused with :class:`LeaseLost` is tried once more if the lease had only lapsed
(this replica stalled past its TTL: a busy machine, a long pause) and nobody took the
stream meanwhile: :meth:`Store.renew_lease` takes it back, and the stream goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from prometheus_client import Counter

from sluicegate.store.base import Store
from sluicegate.store.errors import LeaseLost

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FencedLog:
    """Appends and the finish of one stream, as ``owner``, with lapsed leases taken back."""

    def __init__(
        self, store: Store, stream_id: str, owner: str, lease_ttl: float, reclaimed: Counter
    ) -> None:
        self.store = store
        self.stream_id = stream_id
        self.owner = owner
        self.lease_ttl = lease_ttl
        #: Leases taken back (``stream_leases_reclaimed_total``).
        self.reclaimed = reclaimed

    async def append(self, data: bytes, token_ids: Sequence[int]) -> int | None:
        """The event's seq (None: not logged, ``fail_open`` with the store down)."""
        store, sid, owner = self.store, self.stream_id, self.owner
        return await self._fenced(lambda: store.append(sid, data, token_ids=token_ids, owner=owner))

    async def finish(self) -> None:
        await self._fenced(lambda: self.store.finish(self.stream_id, owner=self.owner))

    async def _fenced(self, write: Callable[[], Awaitable[T]]) -> T:
        try:
            return await write()
        except LeaseLost:
            if not await self.store.renew_lease(self.stream_id, self.owner, self.lease_ttl):
                raise
        self.reclaimed.inc()
        logger.warning("stream %s: generation lease had lapsed; taken back", self.stream_id)
        return await write()
