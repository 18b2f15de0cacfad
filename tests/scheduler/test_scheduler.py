"""Scheduler tests with a fake engine: no model, no threads, no sockets."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from sluicegate.scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.scheduler.step import StepPlan, StepResult
from tests.fake_clock import FakeClock

EOS = 0


class FakeEngine:
    """Samples token ``7`` unless told otherwise; records every plan."""

    def __init__(self, eos_after: dict[str, int] | None = None) -> None:
        self.plans: list[StepPlan] = []
        self.eos_after = eos_after or {}

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult()
        for seq in plan.sequences:
            if seq.sample:
                stop_at = self.eos_after.get(seq.request_id)
                result.sampled_token_ids[seq.request_id] = (
                    EOS if stop_at is not None and seq.output_index >= stop_at else 7
                )
        return result


def make_request(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=SamplingParams(max_tokens=max_tokens, seed=1),
        priority=priority,
    )


def run_to_completion(sched: Scheduler, engine: FakeEngine, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished_requests:
        plan = sched.schedule()
        sched.update_from_output(plan, engine.step(plan))
        steps += 1
        assert steps < max_steps
    return steps


def config(**kw: Any) -> SchedulerConfig:
    base = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 512}
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_budget_and_seq_limit_never_exceeded() -> None:
    rng = random.Random(0)
    sched = Scheduler(config(max_num_seqs=5, max_num_batched_tokens=48), eos_token_ids=(EOS,))
    engine = FakeEngine()
    reqs = [make_request(f"r{i}", rng.randint(1, 200), rng.randint(1, 40)) for i in range(30)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, engine)
    for plan in engine.plans:
        assert plan.num_batched_tokens <= 48
        assert len(plan.sequences) <= 5
        assert len({s.kv_slot for s in plan.sequences}) == len(plan.sequences)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling.max_tokens


def test_chunked_prefill_covers_long_prompt_exactly_once() -> None:
    sched = Scheduler(config(max_num_batched_tokens=32), eos_token_ids=(EOS,))
    engine = FakeEngine()
    req = make_request("long", 100, 3)
    sched.add_request(req)
    run_to_completion(sched, engine)
    chunks = [
        (s.start_position, s.num_new_tokens, s.sample) for p in engine.plans for s in p.sequences
    ]
    # 100 prompt tokens in chunks of 32: 32, 32, 32, 4 (the last one samples), then decodes.
    assert chunks[:4] == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert chunks[4:] == [(100, 1, True), (101, 1, True)]
    assert req.num_output_tokens == 3


def test_running_sequences_decode_while_a_long_prompt_prefills() -> None:
    sched = Scheduler(config(max_num_batched_tokens=16), eos_token_ids=(EOS,))
    engine = FakeEngine()
    short = make_request("short", 4, 20)
    sched.add_request(short)
    sched.update_from_output(plan := sched.schedule(), engine.step(plan))
    sched.add_request(make_request("long", 200, 2))
    for _ in range(5):
        plan = sched.schedule()
        ids = [s.request_id for s in plan.sequences]
        assert ids[0] == "short"  # running first, every step
        sched.update_from_output(plan, engine.step(plan))


def test_finished_and_aborted_release_slots_and_blocks() -> None:
    sched = Scheduler(config(max_num_seqs=2), eos_token_ids=(EOS,))
    engine = FakeEngine(eos_after={"a": 2})
    a, b, c = make_request("a", 10, 50), make_request("b", 10, 50), make_request("c", 10, 5)
    for r in (a, b, c):
        sched.add_request(r)
    plan = sched.schedule()
    assert {s.request_id for s in plan.sequences} == {"a", "b"}  # only 2 slots
    sched.update_from_output(plan, engine.step(plan))
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert b.finish_reason == FinishReason.ABORT and b.kv_slot is None
    run_to_completion(sched, engine)
    assert a.finish_reason == FinishReason.STOP and a.num_output_tokens == 3
    assert c.status == RequestStatus.FINISHED_LENGTH
    stats = sched.make_stats()
    assert stats.kv_cache.num_used_blocks == 0
    assert stats.kv_cache.num_free_slots == 2
    assert not sched.requests


def test_abort_while_waiting() -> None:
    sched = Scheduler(config(max_num_seqs=1), eos_token_ids=(EOS,))
    sched.add_request(make_request("a", 4, 5))
    sched.add_request(make_request("b", 4, 5))
    sched.schedule()
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert len(sched.waiting) == 0


def test_priority_orders_admission() -> None:
    sched = Scheduler(config(max_num_seqs=1), eos_token_ids=(EOS,))
    sched.add_request(make_request("batch", 4, 1, priority=1))
    sched.add_request(make_request("interactive", 4, 1, priority=0))
    plan = sched.schedule()
    assert [s.request_id for s in plan.sequences] == ["interactive"]


def test_kv_pressure_preempts_newest_and_it_resumes_with_same_tokens() -> None:
    # 6 blocks of 16 tokens: two sequences growing to 60 tokens each cannot both fit.
    sched = Scheduler(
        config(max_num_seqs=2, num_kv_blocks=6, kv_block_size=16, max_num_batched_tokens=64),
        eos_token_ids=(EOS,),
    )
    engine = FakeEngine()
    a, b = make_request("a", 20, 40), make_request("b", 20, 40)
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, engine)
    assert sched.make_stats().num_preemptions_total >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == 40 and b.num_output_tokens == 40
    # After preemption the whole sequence (prompt + generated) was recomputed from 0.
    restarts = [
        s
        for p in engine.plans
        for s in p.sequences
        if s.request_id == "b" and s.start_position == 0
    ]
    assert len(restarts) == 1 + b.num_preemptions
    assert sched.make_stats().kv_cache.num_used_blocks == 0


def test_max_model_len_finishes_with_length() -> None:
    sched = Scheduler(config(max_model_len=12), eos_token_ids=(EOS,))
    req = make_request("a", 10, 100)
    sched.add_request(req)
    run_to_completion(sched, FakeEngine())
    assert req.finish_reason == FinishReason.LENGTH and req.num_tokens == 12


def test_waiting_work_takes_the_slot_of_a_paused_sequence() -> None:
    sched = Scheduler(config(max_num_seqs=1), eos_token_ids=(EOS,))
    engine = FakeEngine()
    slow, fresh = make_request("slow", 4, 50), make_request("fresh", 4, 3)
    sched.add_request(slow)
    sched.update_from_output(plan := sched.schedule(), engine.step(plan))
    sched.pause("slow")
    sched.add_request(fresh)
    plan = sched.schedule()
    assert [s.request_id for s in plan.sequences] == ["fresh"]
    assert slow.num_preemptions == 1 and slow.request_id in sched.idle.parked
    while not fresh.status.is_finished:
        sched.update_from_output(plan, engine.step(plan))
        plan = sched.schedule()
    sched.resume("slow")  # back in line, re-prefilled from its tokens
    run_to_completion(sched, engine)
    assert slow.num_output_tokens == 50 and fresh.num_output_tokens == 3


# --- pause, preemption and throttling: the scheduler owns them ---


def clocked(**kw: Any) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    return Scheduler(config(**kw), eos_token_ids=(EOS,), clock=clock), clock


def step(sched: Scheduler, engine: FakeEngine) -> StepPlan:
    plan = sched.schedule()
    sched.update_from_output(plan, engine.step(plan))
    return plan


def test_a_paused_sequence_is_skipped_keeps_its_kv_and_gives_up_its_seat() -> None:
    sched, clock = clocked(max_num_seqs=2)
    engine = FakeEngine()
    slow, other = make_request("slow", 4, 50), make_request("other", 4, 50)
    sched.add_request(slow)
    sched.add_request(other)
    assert sched.capacity.try_reserve("slow", slow.max_total_tokens)
    assert sched.capacity.try_reserve("other", other.max_total_tokens)
    step(sched, engine)
    assert sched.capacity.num_holding == 2
    assert sched.pause("slow") and not sched.pause("slow")  # asking twice is harmless
    assert sched.capacity.num_holding == 1  # its seat is free for queued work
    produced = slow.num_output_tokens
    for _ in range(5):
        plan = step(sched, engine)
        assert [s.request_id for s in plan.sequences] == ["other"]
    assert slow.num_output_tokens == produced
    assert slow.status == RequestStatus.RUNNING and slow.kv_slot is not None  # KV kept
    assert sched.make_stats().num_paused == 1
    clock.advance(2.5)
    assert sched.resume("slow") == 2.5
    assert sched.resume("slow") is None
    assert sched.capacity.num_holding == 2
    assert slow.pause.total_seconds == 2.5
    assert "slow" in {s.request_id for s in step(sched, engine).sequences}


def test_a_long_pause_frees_kv_and_resume_re_prefills_the_same_tokens() -> None:
    sched, clock = (
        Scheduler(
            config(pause_preempt_seconds=1.0), eos_token_ids=(EOS,), clock=(c := FakeClock())
        ),
        c,
    )
    engine = FakeEngine()
    slow = make_request("slow", 8, 20)
    sched.add_request(slow)
    for _ in range(3):
        step(sched, engine)
    sched.pause("slow")
    clock.advance(0.4)
    assert sched.preempt_long_pauses() == 0
    assert sched.seconds_until_long_pause() == pytest.approx(0.6)
    clock.advance(0.6)
    assert sched.preempt_long_pauses() == 1
    assert slow.status == RequestStatus.PREEMPTED and slow.kv_slot is None
    assert sched.make_stats().kv_cache.num_used_blocks == 0
    assert sched.make_stats().preemptions_by_reason == {"long_pause": 1}
    assert sched.seconds_until_long_pause() is None
    assert not sched.has_schedulable_work  # parked: nothing to compute until resumed
    tokens = list(slow.all_token_ids)
    sched.resume("slow")
    plan = step(sched, engine)
    (seq,) = plan.sequences
    assert seq.start_position == 0 and seq.num_new_tokens == len(tokens)  # re-prefill
    run_to_completion(sched, engine)
    assert slow.all_token_ids[: len(tokens)] == tokens and slow.num_output_tokens == 20


def test_without_a_long_pause_limit_a_paused_sequence_keeps_its_kv() -> None:
    sched, clock = clocked()
    engine = FakeEngine()
    slow = make_request("slow", 8, 20)
    sched.add_request(slow)
    step(sched, engine)
    sched.pause("slow")
    clock.advance(3600)
    assert sched.preempt_long_pauses() == 0 and sched.seconds_until_long_pause() is None
    assert slow.status == RequestStatus.RUNNING


def test_kv_pressure_preempts_a_paused_sequence_before_a_running_one() -> None:
    sched, _ = clocked(max_num_seqs=3, num_kv_blocks=6, kv_block_size=16)
    engine = FakeEngine()
    reqs = [make_request(name, 20, 40) for name in ("a", "b", "c")]
    for r in reqs:
        sched.add_request(r)
    step(sched, engine)
    sched.pause("a")
    run_to_completion_or(sched, engine, until=lambda: reqs[0].status == RequestStatus.PREEMPTED)
    assert reqs[0].num_preemptions == 1
    assert reqs[1].num_preemptions == 0 and reqs[2].num_preemptions == 0


def run_to_completion_or(
    sched: Scheduler, engine: FakeEngine, until: Callable[[], bool], max_steps: int = 1000
) -> None:
    for _ in range(max_steps):
        if until() or not sched.has_unfinished_requests:
            return
        step(sched, engine)


def test_a_throttled_sequence_decodes_at_its_pace() -> None:
    sched, clock = clocked()
    engine = FakeEngine()
    slow, fast = make_request("slow", 4, 10), make_request("fast", 4, 10)
    slow.pace.min_token_interval_seconds = 0.5
    sched.add_request(slow)
    sched.add_request(fast)
    step(sched, engine)  # prefill: both sample their first token
    assert slow.num_output_tokens == 1
    for _ in range(4):
        step(sched, engine)
    # One token of slack, then one per 0.5 s while the batch runs on.
    assert slow.num_output_tokens == 2 and fast.num_output_tokens == 5
    clock.advance(0.5)
    step(sched, engine)
    assert slow.num_output_tokens == 3


def test_a_stop_token_is_flagged_once_by_the_scheduler() -> None:
    sched, _ = clocked()
    engine = FakeEngine(eos_after={"a": 2})
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, seed=1, stop_token_ids=(7,)))
    sched.add_request(req)
    plan = sched.schedule()
    (event,) = sched.update_from_output(plan, engine.step(plan))
    assert event.finished and event.is_stop_token  # 7 is a stop token id
    assert req.finish_reason == FinishReason.STOP
    ignored = make_request("b", 3, 2)
    ignored.sampling = SamplingParams(max_tokens=2, seed=1, ignore_eos=True)
    sched.add_request(ignored)
    events = []
    while sched.has_unfinished_requests:
        plan = sched.schedule()
        events += sched.update_from_output(plan, FakeEngine(eos_after={"b": 0}).step(plan))
    assert [e.is_stop_token for e in events] == [False, False]  # EOS ignored: no stop
    assert ignored.finish_reason == FinishReason.LENGTH


def test_finishing_releases_the_dispatch_seat() -> None:
    sched, _ = clocked(max_num_seqs=1)
    changes: list[int] = []
    sched.capacity.on_change = lambda: changes.append(sched.capacity.num_holding)
    req = make_request("a", 4, 3)
    assert sched.capacity.try_reserve("a", req.max_total_tokens)
    assert not sched.capacity.fits(1)
    sched.add_request(req)
    run_to_completion(sched, FakeEngine())
    assert changes == [0] and sched.capacity.fits(1)


def test_throttled_sequences_lend_their_seats_and_slots_to_queued_work() -> None:
    """Four streams at a slow pace on four seats: the fifth request still runs at once."""
    sched, clock = clocked(max_num_seqs=4)
    engine = FakeEngine()
    capacity = sched.capacity
    paced = [make_request(f"paced{i}", 4, 5) for i in range(4)]
    for request in paced:
        request.pace.min_token_interval_seconds = 1.0  # one token a second
        assert capacity.try_reserve(request.request_id, request.max_total_tokens, request)
        sched.add_request(request)
    assert capacity.seats_full
    for _ in range(3):
        step(sched, engine)
    # One token of slack, then each waits a second for the next: their seats are lent.
    assert all(r.num_output_tokens == 2 for r in paced)
    assert capacity.num_free_seats == 4 and capacity.num_holding == 0
    assert all(r.pace.throttled for r in paced) and sched.make_stats().num_throttled == 4
    assert not sched.has_schedulable_work
    assert sched.seconds_until_wake() == pytest.approx(1.0)
    # Their seats are lent: the dispatcher may hand over more work, which takes the slot of
    # the throttled sequence whose next token is furthest away.
    fresh = make_request("fresh", 4, 3)
    assert capacity.try_reserve("fresh", fresh.max_total_tokens, fresh)
    sched.add_request(fresh)
    run_to_completion_or(sched, engine, until=lambda: fresh.status.is_finished)
    assert fresh.status == RequestStatus.FINISHED_LENGTH
    assert sum(r.num_preemptions for r in paced) == 1
    assert all(r.num_output_tokens == 2 for r in paced)  # nothing ran ahead of its pace
    # When their pace allows, they take their seats back and finish (re-prefilling the
    # one whose KV was lent), one token a second.
    for second in range(1, 4):
        clock.advance(1.0)
        assert sched.release_paced() == 4
        assert capacity.num_holding == 4
        run_to_completion_or(
            sched,
            engine,
            until=lambda: all(r.pace.throttled or r.status.is_finished for r in paced),
        )
        assert all(r.num_output_tokens == 2 + second for r in paced)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in paced)
    assert capacity.num_holding == 0 and not sched.idle.throttled


def test_a_pace_faster_than_a_step_keeps_its_seat() -> None:
    sched, clock = clocked(max_num_seqs=1)
    engine = FakeEngine()
    quick = make_request("quick", 4, 20)
    quick.pace.min_token_interval_seconds = 0.01
    assert sched.capacity.try_reserve("quick", quick.max_total_tokens, quick)
    sched.add_request(quick)
    plan = step(sched, engine)
    sched.record_step(plan, 0.05)  # a step takes longer than the pace's interval
    for _ in range(3):
        plan = step(sched, engine)
        clock.advance(0.05)
    assert not quick.pace.throttled and sched.capacity.seats_full
