"""KV cache accounting: slots (rows of the engine's cache) and blocks (usage units).

The engine preallocates one cache row ("slot") per concurrent sequence; the scheduler
hands slots out and counts how many fixed-size blocks each sequence's cached tokens
occupy.  The block pool may be smaller than ``slots × max_model_len`` (over-commit):
that is what makes KV pressure, and therefore preemption, possible.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def __init__(self, num_slots: int, num_blocks: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low slot numbers are reused first, which keeps the engine's
        # active rows dense.
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._blocks_by_request: dict[str, int] = {}
        self._num_used_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_used_blocks

    def allocate_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

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
        if slot is not None:
            self._free_slots.append(slot)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_slots=self.num_slots,
            num_free_slots=len(self._free_slots),
            num_blocks=self.num_blocks,
            num_used_blocks=self._num_used_blocks,
        )
