"""The KV cache's memory budget: how many slots the engine allocates, once, at load.

The cache is allocated in full when the engine loads, so the process's memory under
overload is what it was at rest.  The budget is ``kv_cache_memory``: an explicit size, or
``auto`` (:func:`auto_kv_cache_memory`).  The engine holds as many whole slots as fit,
up to ``max_num_seqs``; the scheduler and the dispatcher plan with that many.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluicegate.sizes import format_memory_size

MEMINFO_PATH = Path("/proc/meminfo")
#: ``auto`` takes at most this share of the machine's memory (MemTotal) ...
AUTO_MAX_SHARE_OF_TOTAL = 0.25
#: ... and of what is available when the engine loads (MemAvailable).
AUTO_MAX_SHARE_OF_AVAILABLE = 0.5


class KVBudgetError(ValueError):
    """The budget holds no sequence of ``max_model_len``; the message says what to change."""


@dataclass(frozen=True, slots=True)
class MemInfo:
    """The machine's memory, from ``/proc/meminfo``."""

    total_bytes: int
    available_bytes: int


def read_meminfo(path: Path = MEMINFO_PATH) -> MemInfo | None:
    """MemTotal and MemAvailable, or None where there is no ``/proc/meminfo``."""
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return MemInfo(fields["MemTotal"], fields["MemAvailable"])


def auto_kv_cache_memory(bytes_per_slot: int, max_num_seqs: int, meminfo: MemInfo | None) -> int:
    """The ``auto`` budget: what ``max_num_seqs`` slots need, capped at
    :data:`AUTO_MAX_SHARE_OF_TOTAL` of MemTotal and :data:`AUTO_MAX_SHARE_OF_AVAILABLE` of
    MemAvailable, but never below one slot (so the engine can always serve).  Without
    ``meminfo`` (not Linux) it is what the slots need."""
    need = bytes_per_slot * max_num_seqs
    if meminfo is None:
        return need
    cap = min(
        int(meminfo.total_bytes * AUTO_MAX_SHARE_OF_TOTAL),
        int(meminfo.available_bytes * AUTO_MAX_SHARE_OF_AVAILABLE),
    )
    return max(bytes_per_slot, min(need, cap))


@dataclass(frozen=True, slots=True)
class KVCacheBudget:
    """The slots a budget buys."""

    budget_bytes: int
    bytes_per_slot: int
    num_slots: int
    auto: bool

    @property
    def allocated_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


def size_kv_cache(
    kv_cache_memory_bytes: int | None,
    bytes_per_slot: int,
    max_num_seqs: int,
    max_model_len: int,
) -> KVCacheBudget:
    """``min(max_num_seqs, budget // bytes_per_slot)`` slots, the budget being
    ``kv_cache_memory_bytes`` or (None) :func:`auto_kv_cache_memory` of this machine.

    Raises :class:`KVBudgetError` if not even one slot fits.
    """
    auto = kv_cache_memory_bytes is None
    budget = (
        auto_kv_cache_memory(bytes_per_slot, max_num_seqs, read_meminfo())
        if kv_cache_memory_bytes is None
        else kv_cache_memory_bytes
    )
    num_slots = min(max_num_seqs, budget // bytes_per_slot)
    if num_slots < 1:
        need = f"{format_memory_size(bytes_per_slot)} ({bytes_per_slot} bytes)"
        raise KVBudgetError(
            f"kv_cache_memory of {format_memory_size(budget)} ({budget} bytes) holds no "
            f"sequence: one sequence of max_model_len {max_model_len} needs {need} of KV "
            "cache; raise --kv-cache-memory to at least that, or lower --max-model-len"
        )
    return KVCacheBudget(budget, bytes_per_slot, num_slots, auto)
