"""The seat limit follows the TPOT objective: from the cost model, then from measurements."""

from __future__ import annotations

import sys
import threading

import pytest

from sluicegate.scheduler.cost_model import StepCostModel, StepShape
from sluicegate.scheduler.seat_limit import SeatLimitConfig, SeatLimiter
from tests.fake_clock import FakeClock

#: 10 ms a step plus 2.5 ms per sequence: 16 sequences take 50 ms.
FIXED, PER_SEQ = 0.010, 0.0025


def step_seconds(num_seqs: int) -> float:
    return FIXED + PER_SEQ * num_seqs


def limiter(objective: float | None, max_num_seqs: int = 64) -> tuple[SeatLimiter, FakeClock]:
    cost = StepCostModel()
    # Prompt tokens cost nothing here (steps with a 256-token chunk take as long).
    shapes = [StepShape(n, n + extra, n * 100) for n in (1, 2, 4, 8, 16, 32) for extra in (0, 256)]
    cost.calibrate([(shape, step_seconds(shape.num_seqs)) for shape in shapes])
    clock = FakeClock()
    config = SeatLimitConfig(max_num_seqs, 512, objective, headroom=1.0)
    seats = SeatLimiter(config, cost, clock)
    for _ in range(200):  # pure decode steps: no prefill share
        seats.on_step(StepShape(8, 8, 800), 8, step_seconds(8))
    clock.advance(1.0)
    seats.update(num_holding=0)
    return seats, clock


def test_the_limit_is_the_largest_batch_the_model_keeps_under_the_objective() -> None:
    seats, _ = limiter(objective=0.050)
    assert seats.limit == 16
    assert seats.estimate.step_seconds == pytest.approx(step_seconds(16), rel=0.05)


def test_without_an_objective_the_limit_is_the_static_ceiling() -> None:
    seats, _ = limiter(objective=None, max_num_seqs=12)
    assert seats.limit == 12


def test_measured_steps_over_the_objective_shrink_the_limit() -> None:
    seats, clock = limiter(objective=0.050)
    for _ in range(10):  # the engine is slower than its model says (another load)
        for _ in range(20):
            seats.on_step(StepShape(16, 16, 1600), 16, 0.080)
        clock.advance(0.6)
        seats.update(num_holding=16)
    assert seats.limit < 16 and seats.correction < 1.0


def test_one_slow_spell_is_cut_once_per_feedback_window() -> None:
    seats, clock = limiter(objective=0.050)
    clock.advance(3.0)  # the warm steps leave the window
    for _ in range(20):  # a spell of slow steps, then the window sees them for 3 s
        seats.on_step(StepShape(16, 16, 1600), 16, 0.080)
    for _ in range(5):  # 2.5 s of updates on that same window
        clock.advance(0.5)
        seats.update(num_holding=16)
    assert seats.correction == pytest.approx(0.85)


def test_the_prefill_share_is_the_typical_prompt_over_its_answer_not_a_burst() -> None:
    seats, clock = limiter(objective=0.050)
    for _ in range(200):
        seats.on_finished(num_prompt_tokens=128, num_output_tokens=64)
    assert seats.prefill_per_decode == pytest.approx(2.0, rel=0.01)
    clock.advance(1.0)
    seats.update(num_holding=0)
    before = seats.limit
    # A burst of arrivals: steps full of prompt chunks beside a few decodes, on time.
    for _ in range(50):
        seats.on_step(StepShape(5, 512, 500), 4, step_seconds(5))
    clock.advance(1.0)
    seats.update(num_holding=4)
    assert seats.prefill_per_decode == pytest.approx(2.0, rel=0.01)
    assert seats.limit == before


def test_measured_steps_well_under_grow_the_limit_back_only_when_it_binds() -> None:
    seats, clock = limiter(objective=0.050)
    seats.correction = 0.5
    for _ in range(5):
        seats.on_step(StepShape(8, 8, 800), 8, 0.02)
        clock.advance(0.6)
        seats.update(num_holding=2)  # far below the limit: no evidence more would fit
    assert seats.correction == 0.5
    for _ in range(5):
        seats.on_step(StepShape(8, 8, 800), 8, 0.02)
        clock.advance(0.6)
        seats.update(num_holding=seats.limit)
    assert seats.correction > 0.5


def test_the_service_estimate_gives_a_start_rate_and_prefill_time() -> None:
    seats, clock = limiter(objective=0.050)
    for _ in range(100):
        seats.on_finished(num_prompt_tokens=200, num_output_tokens=40)
    clock.advance(1.0)
    seats.update(num_holding=0)
    estimate = seats.estimate
    assert estimate.mean_output_tokens == pytest.approx(40, rel=0.05)
    # 16 seats, each busy for ~40 steps of ~50 ms (+ a prefill): ~8 starts a second.
    assert 6.0 < estimate.start_rate < 8.5
    assert estimate.prefill_seconds(2000) > estimate.prefill_seconds(100) > 0


def test_the_event_loop_reads_a_snapshot_while_the_engine_thread_writes() -> None:
    """``/v1/stats`` reads the limiter on the event loop while the engine thread records
    steps: the read must never iterate what the writer is changing (it did, and a stats
    request failed with "deque mutated during iteration")."""
    seats, clock = limiter(objective=0.050)
    done = threading.Event()

    def engine_thread() -> None:
        for i in range(20_000):
            clock.advance(0.001)  # steps leave the 3 s window as new ones come in
            seats.on_step(StepShape(8, 8, 800), 8, step_seconds(8) + (i % 3) * 0.001)
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        writer = threading.Thread(target=engine_thread)
        writer.start()
        reads = 0
        while not done.is_set():
            measured = seats.snapshot()["measured_step_seconds"]
            assert measured is None or 0.0 < measured < 1.0
            reads += 1
        writer.join()
    finally:
        sys.setswitchinterval(interval)
    assert reads > 10


def test_the_limit_does_not_grow_while_prompts_wait_for_the_engine() -> None:
    """Short steps while prompts wait say the prefill is what is short (stall-free prefill
    keeps steps short by giving prompts less), not that more seats would fit."""
    seats, clock = limiter(objective=0.050)
    seats.correction = 0.5
    for _ in range(5):
        seats.on_step(StepShape(8, 8, 800), 8, 0.02)
        clock.advance(0.6)
        seats.update(num_holding=seats.limit, num_waiting=2)
    assert seats.correction == 0.5
    seats.update(num_holding=seats.limit, num_waiting=0)
    clock.advance(0.6)
    seats.update(num_holding=seats.limit, num_waiting=0)
    assert seats.correction > 0.5


def run(seats: SeatLimiter, clock: FakeClock, updates: int, steps: int, seconds: float) -> None:
    """``updates`` times: ``steps`` steps of 16 sequences decoding in ``seconds`` each, then
    0.6 s on and the limiter's update."""
    for _ in range(updates):
        for _ in range(steps):
            seats.on_step(StepShape(16, 16, 1600), 16, seconds)
        clock.advance(0.6)
        seats.update(num_holding=0)


def test_refused_clients_are_booked_on_seats_the_engine_has_shown_it_sustains() -> None:
    """The booking limit is the fewest seats open over the last 30 s, and no more than the
    sequences that have decoded together within the objective lately: the model's 16 seats
    are not promised before the engine has run them."""
    seats, clock = limiter(objective=0.050)
    assert seats.limit == 16 and seats.booking_limit == 8  # 8 decoded together so far
    run(seats, clock, updates=10, steps=20, seconds=0.045)
    assert seats.limit == 16
    assert seats.booking_limit == 16 == seats.estimate.booking_seat_limit
    # A slow spell cuts the limit: bookings follow the cut at once, and stay there for the
    # booking window even after the limit is back.
    run(seats, clock, updates=5, steps=20, seconds=0.08)
    cut = seats.limit
    assert cut < 16 and seats.booking_limit <= cut
    run(seats, clock, updates=7, steps=1, seconds=0.045)  # the slow steps leave the window
    seats.correction = 1.0
    clock.advance(0.6)
    seats.update(num_holding=0)
    assert seats.limit == 16 and seats.booking_limit <= cut
    run(seats, clock, updates=60, steps=5, seconds=0.045)
    assert seats.booking_limit == 16
