"""KV cache accounting: slots (rows of the engine's cache) and blocks (usage units).

The engine preallocates one cache row ("slot") per concurrent sequence; the scheduler
hands slots out and counts how many fixed-size blocks each sequence's cached tokens
occupy.  The block pool may be smaller than ``slots × max_model_len`` (over-commit):
that is what makes KV pressure, and therefore preemption, possible.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.scheduler.prefix_cache import PrefixCache


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    num_slots: int
    num_free_slots: int
    num_blocks: int
    num_used_blocks: int

    @property
    def usage_ratio(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager:
    """Slot and block bookkeeping.  Not thread-safe: owned by the scheduler."""

    def __init__(
        self,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        cache_answers: bool = True,
    ) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low slot numbers are reused first, which keeps the engine's
        # active rows dense.
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._blocks_by_request: dict[str, int] = {}
        self._num_used_blocks = 0
        #: Slots whose content outlives their sequence (None: prefix caching off).
        self.prefix: PrefixCache | None = (
            PrefixCache(block_size, cache_answers) if prefix_caching else None
        )

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_slots(self) -> int:
        """Slots a new sequence can take: empty ones and cached ones (evicted for it)."""
        cached = self.prefix.num_cached_slots if self.prefix is not None else 0
        return len(self._free_slots) + cached

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_used_blocks

    def allocate_slot(self, adopt: int | None = None, keep_tokens: int = 0) -> int | None:
        """A slot for a new sequence: ``adopt`` (a cached slot whose first
        ``keep_tokens`` positions it reuses), else an empty one, else the least recently
        used cached one, emptied."""
        prefix = self.prefix
        if prefix is None:
            return self._free_slots.pop() if self._free_slots else None
        if adopt is not None:
            prefix.take(adopt, keep_tokens=keep_tokens)
            return adopt
        if self._free_slots:
            return self._free_slots.pop()
        return prefix.evict()

    def evict_cached(self, num_slots: int) -> None:
        """Empty cached slots, least recently used first, until ``num_slots`` are empty
        (or none is cached)."""
        while len(self._free_slots) < num_slots and self.prefix is not None:
            slot = self.prefix.evict()
            if slot is None:
                return
            self._free_slots.append(slot)

    def empty_slots(self) -> list[int]:
        """Slots nothing holds or keeps (cached slots not included), lowest first."""
        return sorted(self._free_slots)

    def ensure_capacity(self, request_id: str, num_tokens: int) -> bool:
        """Grow ``request_id``'s reservation to hold ``num_tokens``; False if the pool is dry."""
        have = self._blocks_by_request.get(request_id, 0)
        need = self.blocks_for(num_tokens)
        if need <= have:
            return True
        if need - have > self.num_free_blocks:
            return False
        self._blocks_by_request[request_id] = need
        self._num_used_blocks += need - have
        return True

    def free(self, request_id: str, slot: int | None) -> None:
        self._num_used_blocks -= self._blocks_by_request.pop(request_id, 0)
        if slot is not None and (self.prefix is None or not self.prefix.release(slot)):
            self._free_slots.append(slot)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_slots=self.num_slots,
            num_free_slots=len(self._free_slots),
            num_blocks=self.num_blocks,
            num_used_blocks=self._num_used_blocks,
        )
