"""The embedded engine's KV cache is sized by its memory budget and resident from load."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from sluicegate.engine.kv_budget import KVBudgetError
from sluicegate.engine.torch import TorchEngine
from sluicegate.engine.torch.attention_batch import cache_positions
from tests.engine.torch.conftest import TEST_THREADS
from tests.engine.torch.drive import generate

pytestmark = [pytest.mark.model, pytest.mark.slow]

#: SmolLM2-135M: 30 layers x (keys + values) x 3 KV heads x 64 dims, in float32.
BYTES_PER_POSITION = 30 * 2 * 3 * 64 * 4
MAX_MODEL_LEN = 256  # a multiple of KEY_ALIGN: no padding, one block more (288)
BYTES_PER_SLOT = BYTES_PER_POSITION * cache_positions(MAX_MODEL_LEN)  # 12.66 MiB


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(path: str, cache_dir: Path, kv_cache_memory_bytes: int) -> TorchEngine:
    return TorchEngine(
        path,
        dtype="float32",
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        cache_dir=str(cache_dir),
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        num_threads=TEST_THREADS,
    )


def test_a_budget_caps_the_slots_and_is_resident_at_load(
    smollm2_path: str, torch_cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluicegate.engine.torch.runner")
    before = resident_bytes()
    engine = load(smollm2_path, torch_cache_dir, BYTES_PER_SLOT * 3 + BYTES_PER_SLOT // 2)
    loaded = resident_bytes()
    try:
        args = engine.args
        assert (args.n_layers, args.n_kv_heads, args.head_dim) == (30, 3, 64)
        assert engine.max_num_seqs == engine.limits.max_num_seqs == 3
        assert engine.kv_cache_bytes == 3 * BYTES_PER_SLOT
        assert engine.model.k_cache.shape[1] == 3
        assert "KV cache: 3 slots x 256 positions (max_num_seqs 8 does not fit)" in caplog.text
        # Resident at load: touching every page afterwards (what a full batch of long
        # sequences would do) adds no memory.
        assert loaded - before >= 0.9 * engine.kv_cache_bytes
        engine.model.k_cache.fill_(0)
        engine.model.v_cache.fill_(0)
        assert resident_bytes() - loaded < 0.05 * engine.kv_cache_bytes
        # The scheduler plans within the 3 slots: 5 requests share them.
        outputs = generate(engine, [[1, 2, 3, 4 + i] for i in range(5)], max_new_tokens=3)
        assert [len(o) for o in outputs] == [3] * 5
    finally:
        engine.close()


def test_a_budget_without_room_for_one_sequence_fails_to_load(
    smollm2_path: str, torch_cache_dir: Path
) -> None:
    with pytest.raises(KVBudgetError) as info:
        load(smollm2_path, torch_cache_dir, 2**20)
    assert str(info.value) == (
        "kv_cache_memory of 1 MiB (1048576 bytes) holds no sequence: one sequence of "
        "max_model_len 256 needs 12.66 MiB (13271040 bytes) of KV cache; raise "
        "--kv-cache-memory to at least that, or lower --max-model-len"
    )
