"""The KV cache budget: sizes to slots, and the ``auto`` rule against a fake meminfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine import kv_budget
from sluicegate.engine.kv_budget import (
    KVBudgetError,
    MemInfo,
    auto_kv_cache_memory,
    read_meminfo,
    size_kv_cache,
)

GIB = 2**30
MIB = 2**20

MEMINFO = """\
MemTotal:       24684092 kB
MemFree:        23406920 kB
MemAvailable:   23672368 kB
Buffers:            2448 kB
HugePages_Total:       0
"""


def test_read_meminfo(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    assert read_meminfo(path) == MemInfo(24684092 * 1024, 23672368 * 1024)
    assert read_meminfo(tmp_path / "absent") is None
    path.write_text("MemTotal: 1 kB\n")
    assert read_meminfo(path) is None


def test_auto_is_what_the_slots_need_when_it_fits() -> None:
    meminfo = MemInfo(total_bytes=16 * GIB, available_bytes=12 * GIB)
    assert auto_kv_cache_memory(45 * MIB, 32, meminfo) == 32 * 45 * MIB


def test_auto_takes_at_most_a_quarter_of_total_memory() -> None:
    meminfo = MemInfo(total_bytes=4 * GIB, available_bytes=4 * GIB)
    assert auto_kv_cache_memory(100 * MIB, 32, meminfo) == GIB


def test_auto_takes_at_most_half_of_available_memory() -> None:
    meminfo = MemInfo(total_bytes=16 * GIB, available_bytes=1 * GIB)
    assert auto_kv_cache_memory(100 * MIB, 32, meminfo) == GIB // 2


def test_auto_is_never_below_one_sequence() -> None:
    meminfo = MemInfo(total_bytes=1 * GIB, available_bytes=100 * MIB)
    assert auto_kv_cache_memory(300 * MIB, 32, meminfo) == 300 * MIB


def test_auto_without_meminfo_is_what_the_slots_need() -> None:
    assert auto_kv_cache_memory(45 * MIB, 4, None) == 4 * 45 * MIB


def test_budget_caps_the_slots() -> None:
    budget = size_kv_cache(3 * MIB + 5, MIB, max_num_seqs=8, max_model_len=512)
    assert (budget.num_slots, budget.allocated_bytes, budget.auto) == (3, 3 * MIB, False)
    assert size_kv_cache(100 * MIB, MIB, max_num_seqs=8, max_model_len=512).num_slots == 8


def test_auto_budget_applies_the_rule_to_meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = MemInfo(total_bytes=8 * GIB, available_bytes=8 * GIB)
    monkeypatch.setattr(kv_budget, "read_meminfo", lambda: meminfo)
    budget = size_kv_cache(None, 300 * MIB, max_num_seqs=32, max_model_len=2048)
    assert (budget.budget_bytes, budget.num_slots, budget.auto) == (2 * GIB, 6, True)


def test_a_budget_without_room_for_one_sequence_says_what_to_change() -> None:
    with pytest.raises(KVBudgetError) as info:
        size_kv_cache(10 * MIB, 45 * MIB, max_num_seqs=8, max_model_len=2048)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "kv_cache_memory of 10 MiB (10485760 bytes) holds no sequence: one sequence of "
        "max_model_len 2048 needs 45 MiB (47185920 bytes) of KV cache; raise "
        "--kv-cache-memory to at least that, or lower --max-model-len"
    )
