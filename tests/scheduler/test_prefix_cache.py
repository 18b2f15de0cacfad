"""The prefix cache's bookkeeping: block keys, longest match, cached slots reused least
recently used first, and the scheduler's use of them (adopt, copy, re-prefill)."""

from __future__ import annotations

from sluicegate.scheduler.kv_cache import KVCacheManager
from sluicegate.scheduler.prefix_cache import PrefixCache, block_keys
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import FakeEngine, config, run_to_completion


def test_a_blocks_key_names_everything_before_it() -> None:
    a = block_keys(list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens are no full block
    assert block_keys(list(range(32)) + [99] * 8, 16) == a
    changed_first = block_keys([5, *range(1, 40)], 16)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # a chain, not per block
    assert block_keys(list(range(40)), 16, namespace="tenant-b") != a
    assert block_keys(list(range(40)), 16, keys=a[:1]) == a  # extends known keys


def test_the_longest_registered_run_wins_and_the_last_token_is_never_reused() -> None:
    cache = PrefixCache(16)
    keys = block_keys(list(range(64)), 16)
    cache.register(3, keys[:2])
    cache.register(5, keys)
    hit = cache.lookup(keys, max_tokens=63)
    assert hit is not None and (hit.slot, hit.num_tokens) == (5, 48)  # 64 would leave none
    # Past the last full block, the slot's own tokens extend the match one by one.
    cache.register(5, keys, list(range(64)))
    hit = cache.lookup(keys, max_tokens=63, token_ids=list(range(64)))
    assert hit is not None and hit.num_tokens == 63
    assert cache.peek(request("p", [*range(60), 7, 7])) == 60
    assert cache.lookup(block_keys([9] * 32, 16), 31) is None


def test_finished_slots_stay_cached_until_a_slot_is_needed_lru_first() -> None:
    kv = KVCacheManager(num_slots=2, num_blocks=100, block_size=16, prefix_caching=True)
    prefix = kv.prefix
    assert prefix is not None
    first, second = kv.allocate_slot(), kv.allocate_slot()
    assert first is not None and second is not None
    prefix.register(first, block_keys([1] * 32, 16))
    prefix.register(second, block_keys([2] * 32, 16))
    kv.free("a", first)
    kv.free("b", second)
    assert kv.num_free_slots == 2 and prefix.num_cached_slots == 2
    assert kv.allocate_slot() == first  # the least recently used, emptied
    assert prefix.lookup(block_keys([1] * 32, 16), 31) is None
    assert prefix.lookup(block_keys([2] * 32, 16), 31) is not None
    assert prefix.stats.evictions == 1


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=1, ignore_eos=True))


def test_the_scheduler_adopts_a_cached_slot_or_copies_from_a_running_one() -> None:
    sched = Scheduler(config(prefix_caching=True, max_num_batched_tokens=256))
    engine = FakeEngine()
    prompt = list(range(1, 101))  # 6 full blocks and 4 tokens: 99 reusable
    first = request("first", prompt)
    sched.add_request(first)
    run_to_completion(sched, engine)
    slot = engine.plans[0].sequences[0].kv_slot
    # Alone: it takes the first's cached slot and computes only its last prompt token
    # (past the 6 full blocks, the slot's own tokens are compared one by one).
    again = request("again", prompt, max_tokens=50)
    sched.add_request(again)
    plan = sched.schedule()
    (seq,) = plan.sequences
    assert (seq.kv_slot, seq.start_position, plan.kv_copies) == (slot, 99, [])
    sched.update_from_output(plan, engine.step(plan))
    # While it runs, a third with the same prompt copies those 99 positions from it.
    third = request("third", prompt)
    sched.add_request(third)
    plan = sched.schedule()
    new = next(s for s in plan.sequences if s.request_id == "third")
    assert new.start_position == 99 and plan.kv_copies == [(slot, new.kv_slot, 99)]
    sched.update_from_output(plan, engine.step(plan))
    run_to_completion(sched, engine)
    stats = sched.make_stats().prefix_cache
    assert stats is not None and stats["hits"] == 2 and stats["copies"] == 1
    assert again.reuse.num_cached_tokens == third.reuse.num_cached_tokens == 99


def test_a_preempted_sequence_re_prefills_from_its_own_cached_slot() -> None:
    # 6 blocks of 16: two sequences growing to 60 tokens cannot both fit.
    sched = Scheduler(config(max_num_seqs=2, num_kv_blocks=6, prefix_caching=True))
    engine = FakeEngine()
    a, b = request("a", list(range(1, 21)), 40), request("b", list(range(101, 121)), 40)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, engine)
    assert b.num_preemptions >= 1
    assert b.reuse.num_cached_tokens >= 16  # the re-prefill reused what it had computed
    assert a.num_output_tokens == b.num_output_tokens == 40
    assert sched.make_stats().kv_cache.num_used_blocks == 0


def test_an_engine_whose_answers_compute_otherwise_offers_only_its_prompts_positions() -> None:
    """With 4-bit weights an answer's tokens take other weights than a prompt's: a later
    prompt that repeats an earlier prompt and its answer reuses only the prompt's blocks
    (computing the answer's tokens as a prompt's), where otherwise it reuses both."""
    reused = {}
    for cache_answers in (True, False):
        sched = Scheduler(
            config(prefix_caching=True, cache_answers=cache_answers, max_num_batched_tokens=256)
        )
        first = request("first", list(range(1, 33)), max_tokens=40)  # 2 blocks of prompt
        sched.add_request(first)
        run_to_completion(sched, FakeEngine())
        assert sched.kv.prefix is not None
        reused[cache_answers] = sched.kv.prefix.peek(request("next", [*first.all_token_ids, 7]))
    # 72 tokens, of which the last (sampled, never computed) holds no position.
    assert reused == {True: 71, False: 32}
