"""The engine, its scheduler and its core built from the settings."""

from __future__ import annotations

from sluicegate.config import load_settings
from sluicegate.engine.factory import (
    LoadedEngine,
    build_engine,
    build_scheduler,
    speculative_tokens,
)
from sluicegate.engine.sim import SimEngine


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


def test_speculation_is_on_by_default_for_the_model_and_only_when_asked_for_the_sim() -> None:
    assert speculative_tokens(load_settings(engine="torch")) == 8
    assert speculative_tokens(load_settings(engine="torch", speculative_tokens=0)) == 0
    # The sim's text repeats: drafts would flatter it unless they are asked for.
    assert speculative_tokens(load_settings(engine="sim")) == 0
    assert speculative_tokens(load_settings(engine="sim", speculative_tokens=4)) == 4
