"""Stall-free prefill and length-aware lanes, with a fake engine and a cost model fitted
to a known law (no model, no threads, no sockets)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sluicegate.scheduler.cost_model import StepShape, chunk_seconds, chunk_tokens
from sluicegate.scheduler.prefill import PrefillConfig, StepTimeBudget
from sluicegate.scheduler.prefill_rate import MIN_STEPS as MIN_RATE_STEPS
from sluicegate.scheduler.prefill_rate import PrefillRate
from sluicegate.scheduler.request import Request, RequestStatus
from sluicegate.scheduler.scheduler import Scheduler
from sluicegate.scheduler.step import StepPlan
from tests.fake_clock import FakeClock
from tests.scheduler.test_scheduler import EOS, FakeEngine, config, make_request

#: The engine's law: 20 ms a step, 1 ms a token, 5 ms a prompt chunk, 1 µs a chunk's
#: query-key pair (a CPU engine's shape, scaled).
LAW = (0.020, 0.0, 0.001, 0.0, 0.005, 1e-6)
OBJECTIVE = 0.1
#: What a step with decoders aims at: the headroom times the objective.
TARGET = 0.8 * OBJECTIVE


def law_seconds(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(LAW, shape.features(), strict=True))


def calibrated(clock: FakeClock | None = None, **prefill: Any) -> Scheduler:
    """A scheduler whose cost model was fitted on steps that follow :data:`LAW`."""
    settings = PrefillConfig(tpot_objective_seconds=OBJECTIVE, **prefill)
    sched = Scheduler(
        config(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096, prefill=settings),
        eos_token_ids=(EOS,),
        clock=clock or FakeClock(),
    )
    shapes = [StepShape(n, n, n * 300) for n in (1, 2, 4, 8)]
    for start in (0, 500, 1500):
        for n in (4, 16, 64, 256):
            shapes.append(StepShape(3, 3 + n, 900 + start + n, 1, n * (start + n)))
    sched.calibrate([(shape, law_seconds(shape)) for shape in shapes])
    return sched


def step(sched: Scheduler, engine: FakeEngine) -> StepPlan:
    plan = sched.schedule()
    sched.update_from_output(plan, engine.step(plan))
    return plan


def decoding(sched: Scheduler, engine: FakeEngine, count: int) -> list[Request]:
    """``count`` requests with short prompts, past their first token."""
    streams = [make_request(f"s{i}", 8, 400) for i in range(count)]
    for r in streams:
        sched.add_request(r)
    while any(r.num_output_tokens == 0 for r in streams):
        step(sched, engine)
    return streams


def prompt_tokens_of(plan: StepPlan, request_id: str) -> int:
    return sum(s.num_new_tokens for s in plan.sequences if s.request_id == request_id)


def test_the_cost_model_inverts_a_chunk() -> None:
    for start in (0, 700, 3000):
        for seconds in (0.01, 0.05, 0.2):
            n = chunk_tokens(LAW, start, seconds)
            assert chunk_seconds(LAW, start, n) <= seconds < chunk_seconds(LAW, start, n + 1)
    assert chunk_tokens(LAW, 0, 0.004) == 0  # not even the chunk's own cost fits


def test_a_long_prompt_is_prefilled_in_chunks_that_keep_each_step_within_the_objective() -> None:
    sched, engine = calibrated(), FakeEngine()
    streams = decoding(sched, engine, 3)
    long = make_request("long", 1500, 4)
    sched.add_request(long)
    chunks: list[int] = []
    while long.num_output_tokens == 0:
        plan = step(sched, engine)
        assert all(prompt_tokens_of(plan, r.request_id) == 1 for r in streams)  # never skipped
        chunks.append(prompt_tokens_of(plan, "long"))
        # The step as the engine's law times it: within the target, but for the floor.
        assert law_seconds(StepShape.of(plan)) <= TARGET * 1.02 or chunks[-1] <= 4
    assert sum(chunks) == 1500 and len(chunks) > 5
    # Attention makes a chunk dearer the further into the prompt: the chunks shrink.
    assert chunks[0] > chunks[-2] > 0
    assert sched.prefill.snapshot()["budget_limited_steps"] >= len(chunks) - 1


def run_with_overruns(
    sched: Scheduler, engine: FakeEngine, overrun: float
) -> list[tuple[StepPlan, float | None]]:
    """Steps while three streams decode and a long prompt arrives, timed by the law
    except every fourth step, which takes ``overrun`` times longer; each plan with the
    target it was planned for."""
    decoding(sched, engine, 3)
    long = make_request("long", 3000, 4)
    sched.add_request(long)
    plans: list[tuple[StepPlan, float | None]] = []
    while long.num_output_tokens == 0:
        target = sched.prefill.step_target_seconds()
        plan = sched.schedule()
        seconds = law_seconds(StepShape.of(plan)) * (overrun if len(plans) % 4 == 3 else 1.0)
        sched.update_from_output(plan, engine.step(plan))
        sched.record_step(plan, seconds)
        plans.append((plan, target))
    return plans


def test_steps_that_overrun_their_prediction_are_aimed_lower() -> None:
    # A quarter of the steps, at random as far as the recent ones tell, run 1.6 times
    # their prediction: at the headroom's 80 ms they would take 128 ms, beyond the 100 ms
    # objective.  The planner aims them at what keeps nearly all within it.
    clock = FakeClock()
    sched, engine = calibrated(clock), FakeEngine()
    plans = run_with_overruns(sched, engine, 1.6)
    fraction = sched.prefill.step_fraction
    assert 0.5 <= fraction < 0.7
    assert sched.prefill.snapshot()["step_fraction_of_objective"] == round(fraction, 3)
    # The later steps were planned on it, scaled by the recent steps' slowdown ...
    late = [(p, t) for p, t in plans[-20:] if StepShape.of(p).num_chunks]
    assert late and all(
        t is not None
        and t <= fraction * OBJECTIVE / 0.8
        and (sched.cost.predict(StepShape.of(p)) <= t * 1.05 or prompt_tokens_of(p, "long") <= 4)
        for p, t in late
    )
    # ... and admission's estimate of a prompt's chunks follows the same target (at
    # the seat limit's next update).
    clock.advance(1.0)
    sched.seats.update(0)
    assert sched.seats.estimate.prefill_step_seconds == pytest.approx(
        fraction * OBJECTIVE / sched.prefill.slowdown
    )


def test_steps_that_keep_to_their_prediction_stay_at_the_headroom() -> None:
    sched, engine = calibrated(), FakeEngine()
    run_with_overruns(sched, engine, 0.7)  # faster than predicted: never above headroom
    assert sched.prefill.step_fraction == 0.8
    sched, engine = calibrated(overrun_quantile=0.0), FakeEngine()
    run_with_overruns(sched, engine, 1.6)  # turned off: the headroom whatever happens
    assert sched.prefill.step_fraction == 0.8
    assert sched.prefill.slowdown == 1.0
    assert sched.seats.estimate.prefill_step_seconds == pytest.approx(TARGET)


def test_without_stall_free_prefill_a_prompt_takes_the_whole_budget() -> None:
    sched, engine = calibrated(stall_free=False), FakeEngine()
    decoding(sched, engine, 3)
    sched.add_request(make_request("long", 1500, 4))
    assert prompt_tokens_of(step(sched, engine), "long") == 512 - 3


def test_a_step_without_decoders_takes_a_short_prompts_time() -> None:
    # No reader waits on it, but a short question arriving meanwhile waits for the step:
    # it takes what fits in long_prompt_seconds (0.3 s), not its whole token budget.
    sched, engine = calibrated(), FakeEngine()
    long = make_request("long", 1500, 4)
    sched.add_request(long)
    plan = step(sched, engine)
    taken = prompt_tokens_of(plan, "long")
    assert taken == chunk_tokens(LAW, 0, 0.3 - LAW[0]) == 224
    assert law_seconds(StepShape.of(plan)) <= 0.3
    short = make_request("short", 40, 4)
    sched.add_request(short)
    assert prompt_tokens_of(step(sched, engine), "short") == 40  # the very next step
    # Admission's estimate chunks a prompt alone the same way as the steps it is in.
    sched, engine = calibrated(), FakeEngine()
    long = make_request("long", 1500, 4)
    sched.add_request(long)
    estimate, seconds = sched.seats.estimate, 0.0
    while long.num_output_tokens == 0:
        seconds += law_seconds(StepShape.of(step(sched, engine)))
    assert estimate.prefill_seconds(1500, num_decoding=0) == pytest.approx(seconds, rel=0.15)
    sched, engine = calibrated(long_prompt_seconds=5.0), FakeEngine()
    sched.add_request(make_request("long", 1500, 4))
    assert prompt_tokens_of(step(sched, engine), "long") == 512  # the whole budget fits


def test_the_floor_keeps_a_prompt_moving_when_the_decoders_fill_the_step() -> None:
    # Seven decoders (27 ms a step by the law) at a 50 ms objective: the headroom's 40 ms
    # leaves room for 7 prompt tokens at the start of a prompt.
    sched, engine = calibrated(), FakeEngine()
    sched.prefill.config = replace(sched.prefill.config, tpot_objective_seconds=0.05)
    decoding(sched, engine, 7)
    sched.add_request(make_request("long", 300, 4))
    # The prompt tokens the seat limit counted on beside each decoded token (a typical
    # prompt over a typical answer: 2 before any request finished) are given while the
    # step stays within the objective itself.
    share = int(sched.seats.prefill_per_decode * 7)
    assert share == 14
    for _ in range(3):
        plan = step(sched, engine)
        assert prompt_tokens_of(plan, "long") == share
        assert law_seconds(StepShape.of(plan)) <= 0.05
    # At 30 ms the decoders alone nearly fill it: only the floor, min_chunk_tokens.
    sched.prefill.config = replace(sched.prefill.config, tpot_objective_seconds=0.03)
    assert prompt_tokens_of(step(sched, engine), "long") == 4
    sched.prefill.config = replace(sched.prefill.config, min_chunk_tokens=20)
    assert prompt_tokens_of(step(sched, engine), "long") == 20


def test_a_short_prompt_is_prefilled_ahead_of_a_long_one() -> None:
    sched, engine = calibrated(long_prompt_tokens=100), FakeEngine()
    decoding(sched, engine, 2)
    long = make_request("long", 2000, 4)
    sched.add_request(long)
    step(sched, engine)
    assert 0 < long.num_computed_tokens < 2000  # it has started
    short = make_request("short", 40, 4)
    sched.add_request(short)
    plan = step(sched, engine)
    assert prompt_tokens_of(plan, "short") == 40
    # The short answer starts first, though the long prompt arrived before it.
    while short.num_output_tokens == 0:
        step(sched, engine)
    assert long.num_output_tokens == 0
    snapshot = sched.prefill.snapshot()
    assert snapshot["lanes"]["short"]["started"] >= 1  # type: ignore[index]
    assert snapshot["lanes"]["long"]["started"] == 1  # type: ignore[index]


def test_a_long_prompt_passed_over_too_long_goes_first() -> None:
    clock = FakeClock()
    sched = calibrated(clock, stall_free=False, long_prompt_tokens=100, max_pass_over_seconds=2.0)
    engine = FakeEngine()
    long = make_request("long", 1000, 4)
    sched.add_request(long)
    shorts = 0

    def busy_step() -> StepPlan:
        # A stream of short prompts that would take every token of every step.
        nonlocal shorts
        for _ in range(8 - len(sched.running)):
            shorts += 1
            sched.add_request(make_request(f"short{shorts}", 90, 1))
        clock.advance(0.5)
        return step(sched, engine)

    passed = [prompt_tokens_of(busy_step(), "long") for _ in range(3)]
    assert passed[1:] == [0, 0]  # passed over while shorts keep coming
    while prompt_tokens_of(busy_step(), "long") == 0:
        assert clock.now < 1000.0 + 5.0, "a long prompt starved"
    assert sched.prefill.num_promoted >= 1


def test_interactive_prompts_come_before_batch_ones_of_any_length() -> None:
    sched, engine = calibrated(long_prompt_tokens=100), FakeEngine()
    sched.add_request(make_request("batch-short", 30, 4, priority=1))
    sched.add_request(make_request("interactive-long", 600, 4, priority=0))
    plan = step(sched, engine)
    assert plan.sequences[0].request_id == "interactive-long"
    split = sched.prefill.snapshot()["tokens_by_phase"]
    assert split["prefill"]["interactive"] == prompt_tokens_of(plan, "interactive-long")  # type: ignore[index]


def test_a_long_prompt_lends_its_seat_while_it_is_prefilled() -> None:
    sched, engine = calibrated(long_prompt_tokens=100), FakeEngine()
    capacity = sched.capacity
    streams = [make_request(f"s{i}", 8, 400) for i in range(2)]
    long = make_request("long", 1500, 4)
    for r in [*streams, long]:
        assert capacity.try_reserve(r.request_id, r.max_total_tokens, r)
        sched.add_request(r)
    assert capacity.num_holding == 3
    step(sched, engine)
    step(sched, engine)
    assert capacity.num_holding == 2  # the long prompt decodes nothing yet
    while long.num_output_tokens == 0:
        step(sched, engine)
    assert capacity.num_holding == 3  # it takes its seat back to decode
    sched.finish_request("long", RequestStatus.FINISHED_ABORTED)
    assert capacity.num_holding == 2


def test_requests_sharing_a_cached_prefix_admitted_in_one_step_get_their_own_slots() -> None:
    sched = Scheduler(config(prefix_caching=True, max_num_batched_tokens=512), eos_token_ids=(EOS,))
    engine = FakeEngine()
    first = make_request("first", 64, 1)
    sched.add_request(first)
    while first.status == RequestStatus.WAITING or not first.status.is_finished:
        step(sched, engine)
    # Its slot is idle and holds the shared prefix: only one of the two may adopt it.
    twins = [make_request(f"twin{i}", 64, 1) for i in range(2)]
    for r in twins:
        r.all_token_ids[-1] = r.prompt_token_ids[-1] = 1000 + int(r.request_id[-1])
        sched.add_request(r)
    plan = sched.schedule()
    assert {s.request_id for s in plan.sequences} == {"twin0", "twin1"}
    assert len({s.kv_slot for s in plan.sequences}) == 2
    assert len(plan.kv_copies) == 1  # the other copies the prefix


def test_admission_predicts_the_chunks_the_scheduler_plans() -> None:
    """The service estimate's prefill time of a long prompt beside decoding streams is
    what the scheduler's own steps add up to (their predicted times), within 15%."""
    clock = FakeClock()
    sched, engine = calibrated(clock), FakeEngine()
    decoding(sched, engine, 3)
    long = make_request("long", 2000, 4)
    long.pace.first_token_due = clock() + 1.0  # admitted on a 1 s objective: behind it
    sched.add_request(long)
    planned = 0.0
    while long.num_output_tokens == 0:
        plan = step(sched, engine)
        planned += sched.cost.predict(StepShape.of(plan))
    sched.seats.update(3)
    predicted = sched.seats.estimate.prefill_seconds(2000, num_decoding=3)
    assert predicted == pytest.approx(planned, rel=0.15)
    # Without stall-free prefill the same prompt takes fewer, costlier steps: sooner.
    one_budget = replace(sched.seats.estimate, prefill_step_seconds=None)
    assert one_budget.prefill_seconds(2000, num_decoding=3) < predicted


def test_prompts_of_one_lane_start_in_the_order_they_were_handed_over() -> None:
    # The dispatcher hands requests over in its fair queue's order, which need not be
    # their arrival order: the scheduler keeps it.
    sched, engine = calibrated(stall_free=False), FakeEngine()
    later = make_request("handed-first", 300, 4)
    earlier = make_request("handed-second", 300, 4)
    later.arrival_time, earlier.arrival_time = 2000.0, 1000.0
    sched.add_request(later)
    sched.add_request(earlier)
    plan = step(sched, engine)
    assert [s.request_id for s in plan.sequences] == ["handed-first", "handed-second"]
    assert prompt_tokens_of(plan, "handed-first") == 300


def test_a_long_prompt_cancelled_while_passed_over_leaves_nothing_behind() -> None:
    clock = FakeClock()
    sched = calibrated(clock, stall_free=False, long_prompt_tokens=100)
    engine = FakeEngine()
    sched.add_request(make_request("long", 1000, 4))
    for i in range(8):
        sched.add_request(make_request(f"short{i}", 90, 1))
    clock.advance(0.5)
    assert prompt_tokens_of(step(sched, engine), "long") == 0  # passed over
    assert sched.prefill.snapshot()["long_passed_over"] == 1
    sched.finish_request("long", RequestStatus.FINISHED_ABORTED)
    step(sched, engine)
    assert sched.prefill.snapshot()["long_passed_over"] == 0


def test_a_prompt_is_paced_to_its_first_tokens_due_time() -> None:
    """Beside decoders that fill the step's target, a prompt whose first token is due gets
    the tokens that prefill it in half the time left (never past the TPOT objective);
    behind that pace a short prompt is prefilled at once, whole, and a long one gets all
    the objective leaves."""
    cost = calibrated().cost

    def tokens(wanted: int, due: float | None, short: bool = True) -> int:
        # 23 ms of the 50 ms objective left after the decoders; the target's none.
        budget = StepTimeBudget(cost, 0.0, 4, 0, 0.023, 0.05)
        return budget.tokens_for(0, wanted, due, short=short)

    most = chunk_tokens(cost.coefficients, 0, 0.023)
    assert 15 <= most <= 20
    assert tokens(60, None) == 4  # no due time: the floor
    # Due in 0.62 s: six 50 ms steps in half of it; 60 tokens take four at most: 10 a step.
    assert tokens(60, 0.62) == 10
    assert chunk_seconds(cost.coefficients, 0, 10) <= 0.023
    # Due in 0.25 s: 2.5 steps in half of it, not enough: the short prompt goes whole.
    assert tokens(60, 0.25) == 60
    assert tokens(60, -1.0) == 60  # late already
    # A long one behind its pace: all the objective leaves (as fast as the streams beside
    # it allow), however long.
    assert tokens(60, 0.25, short=False) == most
    assert tokens(2000, 0.25, short=False) == most


def test_a_short_prompt_due_soon_is_prefilled_in_one_step_beside_the_decoders() -> None:
    clock = FakeClock()
    sched, engine = calibrated(clock), FakeEngine()
    sched.prefill.config = replace(sched.prefill.config, tpot_objective_seconds=0.05)
    decoding(sched, engine, 6)  # (two of the eight slots left)
    plain = make_request("plain", 60, 4)
    sched.add_request(plain)
    assert 0 < prompt_tokens_of(step(sched, engine), "plain") < 60  # no due time: chunks
    while plain.num_output_tokens == 0:
        step(sched, engine)
    due = make_request("due", 60, 4)
    due.pace.first_token_due = clock() + 0.2
    sched.add_request(due)
    plan = step(sched, engine)
    assert prompt_tokens_of(plan, "due") == 60 and due.num_output_tokens == 1
    assert sched.prefill.snapshot()["hurried_steps"] == 1


def test_the_prefill_rate_is_measured_on_steps_that_had_more_prompt_to_give() -> None:
    """Admission books refused clients at the slower of the cost model's prefill and the
    rate measured while prompts waited: only steps that the budget cut short count (one
    that prefilled all there was says nothing of how much more it could have)."""
    rate = PrefillRate()
    for _ in range(MIN_RATE_STEPS - 1):
        rate.observe(20, 0.1)
    assert rate.tokens_per_second is None  # too few yet
    rate.observe(20, 0.1)
    assert rate.tokens_per_second == pytest.approx(200.0)
    sched, engine = calibrated(), FakeEngine()
    sched.prefill.config = replace(sched.prefill.config, tpot_objective_seconds=0.05)
    decoding(sched, engine, 6)
    assert sched.prefill.rate.tokens_per_second is None  # no prompt waited for a step
    sched.add_request(make_request("long", 1000, 4))
    for _ in range(12):
        plan = step(sched, engine)
        sched.record_step(plan, law_seconds(StepShape.of(plan)))
    measured = sched.prefill.rate.tokens_per_second
    assert measured is not None and 50 < measured < 1000
    assert sched.seats.estimate.prefill_tokens_per_second in (None, measured)
