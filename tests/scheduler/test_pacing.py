"""Pace-aware scheduling (qoe): a sequence far ahead of its reader sits out steps while a
reader is behind, keeps its seat and KV, and runs again before its own reader could
catch up; nothing yields while nobody is behind, or under fcfs."""

from __future__ import annotations

from sluicegate.scheduler.pacing import PacingConfig, ReaderPacing, seat_objective_seconds
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.scheduler.step import StepPlan, StepResult
from tests.fake_clock import FakeClock

STEP = 0.02  # seconds a step takes (the clock moves this much per step): 50 tokens/s
PACE = 10.0  # the reader's tokens per second
LEAD = 1.0


def scheduler(enabled: bool, budget: int = 64) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=1024,
        pacing=PacingConfig(enabled=enabled, reading_tokens_per_second=PACE, lead_seconds=LEAD),
    )
    return Scheduler(config, clock=clock), clock


def request(rid: str, max_tokens: int = 200, prompt: int = 4) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, seed=0))


def run(
    sched: Scheduler,
    clock: FakeClock,
    steps: int,
    made: dict[str, list[float]],
    planned: list[set[str]] | None = None,
) -> None:
    """``steps`` steps; records when each request got each token (and who each step ran)."""
    for _ in range(steps):
        plan: StepPlan = sched.schedule()
        if planned is not None:
            planned.append({seq.request_id for seq in plan.sequences})
        result = StepResult()
        for seq in plan.sequences:
            if seq.sample:
                result.sampled_token_ids[seq.request_id] = 7
        clock.advance(STEP)
        for event in sched.update_from_output(plan, result):
            made.setdefault(event.request.request_id, []).append(clock())


def late_tokens(times: list[float], pace: float = PACE) -> list[int]:
    """Tokens made after a reader at ``pace``, starting at the first, needed them."""
    return [i for i, t in enumerate(times) if t > times[0] + i / pace + 1e-9]


def test_sequences_far_ahead_yield_to_a_reader_who_is_behind_and_keep_their_seats() -> None:
    sched, clock = scheduler(enabled=True)
    made: dict[str, list[float]] = {}
    slow, fast = request("slow", max_tokens=100), request("fast", max_tokens=300)
    slow.pace.reading_tokens_per_second = 2.0  # declared: a slow reader, it gets far ahead
    fast.pace.measured_tokens_per_second = 60.0  # measured: reads faster than 50 tokens/s
    for req in (slow, fast):
        assert sched.capacity.try_reserve(req.request_id, req.max_total_tokens, req)
        sched.add_request(req)
    seats = sched.capacity.num_holding
    planned: list[set[str]] = []
    run(sched, clock, 290, made, planned)
    assert sched.capacity.num_holding == seats and slow.kv_slot is not None
    run(sched, clock, 10, made, planned)
    # The fast reader falls behind (it reads faster than any step), so the slow one, more
    # than a second ahead, sat out until a third of a second was left (more than once),
    # and kept its seat and KV all along.
    stats = sched.make_stats().pacing
    assert stats is not None and stats["yields"] >= 2 and stats["yielded_sequence_steps"] > 50
    assert sum("slow" not in step for step in planned) == stats["yielded_sequence_steps"]
    assert sched.make_stats().num_preemptions_total == 0
    # The fast one ran every step; the slow one's reader never waited for a token.
    assert all("fast" in step for step in planned) and len(made["fast"]) == 300
    assert late_tokens(made["slow"], 2.0) == []
    assert len(made["slow"]) < 100


def test_nothing_yields_while_nobody_is_behind_or_under_fcfs() -> None:
    for enabled in (True, False):
        sched, clock = scheduler(enabled=enabled, budget=16)
        made: dict[str, list[float]] = {}
        sched.add_request(request("first", max_tokens=100))
        run(sched, clock, 10, made)
        # A new prompt to prefill (7 steps of 16 tokens) is no reason to yield: the first,
        # far ahead of its reader, runs on, finishes sooner, and frees its seat sooner.
        sched.add_request(request("second", max_tokens=10, prompt=100))
        planned: list[set[str]] = []
        run(sched, clock, 95, made, planned)
        assert all("first" in step for step in planned[: 100 - 10])
        assert len(made["first"]) == 100
        stats = sched.make_stats()
        assert stats.pacing is None or stats.pacing["yields"] == 0


def test_a_readers_pace_is_measured_then_declared_then_the_default_and_never_above_its_cap() -> (
    None
):
    pacing = ReaderPacing(PacingConfig(enabled=True, reading_tokens_per_second=8.0))
    req = request("r")
    assert pacing.pace(req) == 8.0
    req.pace.reading_tokens_per_second = 5.0
    assert pacing.pace(req) == 5.0
    req.pace.measured_tokens_per_second = 12.0
    assert pacing.pace(req) == 12.0
    req.pace.min_token_interval_seconds = 0.25  # max_tokens_per_second 4
    assert pacing.pace(req) == 4.0


def test_the_seat_limit_keeps_the_step_within_the_reading_pace_under_qoe_only() -> None:
    qoe = PacingConfig(enabled=True, reading_tokens_per_second=5.0)
    assert seat_objective_seconds(0.1, qoe) == 0.2
    assert seat_objective_seconds(0.5, qoe) == 0.5  # a looser TPOT objective stands
    assert seat_objective_seconds(0.1, PacingConfig(enabled=False)) == 0.1
    assert seat_objective_seconds(None, qoe) is None  # static admission: no objective
