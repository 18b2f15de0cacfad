from __future__ import annotations

import pytest

from sluicegate.admission.breaker import BreakerConfig, BreakerState, CircuitBreaker, Threshold
from tests.fake_clock import FakeClock

CONFIG = BreakerConfig(
    queue_wait_shed_batch=Threshold(enter_seconds=2.0, exit_seconds=1.0),
    queue_wait_open=Threshold(enter_seconds=10.0, exit_seconds=5.0),
    step_shed_batch=Threshold(enter_seconds=0.5, exit_seconds=0.25),
    step_open=Threshold(enter_seconds=2.0, exit_seconds=1.0),
    window_seconds=10.0,
    min_samples=10,
    min_dwell_seconds=5.0,
    evaluate_interval_seconds=0.0,
)


def _feed_queue_wait(
    clock: FakeClock, breaker: CircuitBreaker, seconds: float, n: int = 20
) -> None:
    for _ in range(n):
        clock.advance(0.01)
        breaker.record_queue_wait(seconds)


def _state(breaker: CircuitBreaker) -> BreakerState:
    # A function call, so that mypy does not narrow the property between reads.
    return breaker.state


def _make() -> tuple[FakeClock, CircuitBreaker, list[tuple[BreakerState, BreakerState]]]:
    clock = FakeClock()
    transitions: list[tuple[BreakerState, BreakerState]] = []
    breaker = CircuitBreaker(CONFIG, clock, on_transition=lambda a, b: transitions.append((a, b)))
    return clock, breaker, transitions


def test_starts_closed_and_stays_closed_when_healthy() -> None:
    clock, breaker, transitions = _make()
    _feed_queue_wait(clock, breaker, 0.5)
    assert _state(breaker) is BreakerState.CLOSED
    assert breaker.retry_after_seconds == 0.0
    assert transitions == []


def test_escalates_at_once_and_relaxes_one_level_at_a_time_after_dwell() -> None:
    clock, breaker, transitions = _make()
    _feed_queue_wait(clock, breaker, 3.0)
    assert _state(breaker) is BreakerState.SHED_BATCH
    _feed_queue_wait(clock, breaker, 20.0, n=40)  # p95 now above the open threshold
    assert _state(breaker) is BreakerState.OPEN

    # Healthy again: after the window forgets the bad samples, it still waits the dwell.
    clock.advance(10.5)
    _feed_queue_wait(clock, breaker, 0.1)
    assert _state(breaker) is BreakerState.SHED_BATCH  # dwell in OPEN passed: one level down
    assert _state(breaker) is BreakerState.SHED_BATCH  # not CLOSED yet: new dwell
    clock.advance(4.0)
    _feed_queue_wait(clock, breaker, 0.1)
    assert _state(breaker) is BreakerState.SHED_BATCH
    clock.advance(1.0)
    assert _state(breaker) is BreakerState.CLOSED
    assert transitions == [
        (BreakerState.CLOSED, BreakerState.SHED_BATCH),
        (BreakerState.SHED_BATCH, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.SHED_BATCH),
        (BreakerState.SHED_BATCH, BreakerState.CLOSED),
    ]


def test_hysteresis_between_exit_and_enter_thresholds_holds_the_state() -> None:
    clock, breaker, _ = _make()
    _feed_queue_wait(clock, breaker, 2.5)
    assert _state(breaker) is BreakerState.SHED_BATCH
    # Between exit (1.0) and enter (2.0): no way back, however long.
    for _ in range(10):
        clock.advance(3.0)
        _feed_queue_wait(clock, breaker, 1.5)
        assert _state(breaker) is BreakerState.SHED_BATCH
    clock.advance(10.5)
    _feed_queue_wait(clock, breaker, 0.9)
    assert _state(breaker) is BreakerState.CLOSED


def test_from_closed_values_between_thresholds_do_not_trip() -> None:
    clock, breaker, _ = _make()
    _feed_queue_wait(clock, breaker, 1.9)
    assert _state(breaker) is BreakerState.CLOSED


def test_engine_step_time_alone_can_trip_it() -> None:
    clock, breaker, _ = _make()
    for _ in range(20):
        clock.advance(0.01)
        breaker.record_step(3.0)
    assert _state(breaker) is BreakerState.OPEN
    snapshot = breaker.snapshot()
    assert snapshot.p95_step_seconds == 3.0
    assert snapshot.p95_queue_wait_seconds is None


def test_too_few_samples_do_not_trip_and_count_as_healthy() -> None:
    clock, breaker, _ = _make()
    _feed_queue_wait(clock, breaker, 60.0, n=9)
    assert _state(breaker) is BreakerState.CLOSED
    _feed_queue_wait(clock, breaker, 60.0, n=1)
    assert _state(breaker) is BreakerState.OPEN
    clock.advance(11.0)  # the window empties: no traffic means no queue
    assert _state(breaker) is BreakerState.SHED_BATCH


def test_p95_ignores_a_few_outliers() -> None:
    clock, breaker, _ = _make()
    _feed_queue_wait(clock, breaker, 0.1, n=96)
    _feed_queue_wait(clock, breaker, 100.0, n=4)
    assert _state(breaker) is BreakerState.CLOSED
    _feed_queue_wait(clock, breaker, 100.0, n=2)
    assert _state(breaker) is BreakerState.OPEN


def test_retry_after_is_the_remaining_dwell() -> None:
    clock, breaker, _ = _make()
    _feed_queue_wait(clock, breaker, 3.0)
    assert _state(breaker) is BreakerState.SHED_BATCH
    assert breaker.retry_after_seconds == pytest.approx(5.0)
    clock.advance(3.0)
    assert breaker.retry_after_seconds == pytest.approx(2.0)
    clock.advance(3.0)
    assert breaker.retry_after_seconds == 1.0


def test_state_is_cached_between_evaluations() -> None:
    clock = FakeClock()
    config = BreakerConfig(min_samples=1, evaluate_interval_seconds=1.0)
    breaker = CircuitBreaker(config, clock)
    assert _state(breaker) is BreakerState.CLOSED
    breaker.record_queue_wait(30.0)
    assert _state(breaker) is BreakerState.CLOSED  # not re-evaluated yet
    clock.advance(1.0)
    assert _state(breaker) is BreakerState.OPEN
    assert BreakerState.OPEN.label == "open"


def test_invalid_thresholds() -> None:
    with pytest.raises(ValueError, match="exit_seconds < enter_seconds"):
        Threshold(enter_seconds=1.0, exit_seconds=1.0)
    with pytest.raises(ValueError, match="must be at least"):
        BreakerConfig(
            queue_wait_shed_batch=Threshold(5.0, 1.0), queue_wait_open=Threshold(4.0, 2.0)
        )
