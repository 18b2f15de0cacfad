"""The stages built from the settings: the scheduler plans with the engine's real slots."""

from __future__ import annotations

from sluicegate.config import load_settings
from sluicegate.engine.factory import LoadedEngine, build_engine
from sluicegate.engine.sim import SimEngine
from sluicegate.service.build import build_scheduler


def test_scheduler_and_dispatch_use_the_slots_the_engine_has() -> None:
    settings = load_settings(engine="sim", max_num_seqs=8, max_model_len=256)
    sim = SimEngine()
    # An engine whose KV budget bought 3 of the 8 slots asked for.
    loaded = LoadedEngine(sim, sim.tokenizer, sim.model_name, 256, max_num_seqs=3)
    scheduler = build_scheduler(settings, loaded)
    assert scheduler.config.max_num_seqs == 3
    assert scheduler.capacity.max_num_seqs == 3
    assert scheduler.config.total_kv_blocks == 3 * 256 // settings.kv_block_size


def test_sim_engine_has_every_slot_and_no_kv_bytes() -> None:
    settings = load_settings(engine="sim", max_num_seqs=8)
    loaded = build_engine(settings)
    assert loaded.max_num_seqs == 8
    assert loaded.engine.kv_cache_bytes == 0
    assert build_scheduler(settings, loaded).config.max_num_seqs == 8
