from __future__ import annotations

import random

import pytest

from sluicegate.admission.retry_after import ServiceRateEstimator, retry_after_header_value
from tests.fake_clock import FakeClock


def _steady(
    clock: FakeClock,
    estimator: ServiceRateEstimator,
    rate: float,
    seconds: float,
    tokens_each: int = 0,
) -> None:
    for _ in range(int(rate * seconds)):
        clock.advance(1.0 / rate)
        estimator.record_completion(tokens_each)


@pytest.mark.parametrize("rate", [0.5, 3.0, 40.0, 800.0])
def test_converges_on_a_steady_rate(rate: float) -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(window_seconds=10.0, min_completions=3, clock=clock)
    _steady(clock, estimator, rate, seconds=30.0, tokens_each=100)
    rps = estimator.requests_per_second()
    tps = estimator.tokens_per_second()
    assert rps == pytest.approx(rate, rel=0.05)
    assert tps == pytest.approx(rate * 100, rel=0.05)


@pytest.mark.parametrize(("queued", "rate"), [(10, 2.0), (100, 25.0), (7, 0.5), (1000, 300.0)])
def test_wait_for_n_queued_at_rate_r_is_n_over_r(queued: int, rate: float) -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(window_seconds=10.0, clock=clock)
    _steady(clock, estimator, rate, seconds=20.0, tokens_each=50)
    assert estimator.estimate_wait_seconds(queued) == pytest.approx(queued / rate, rel=0.10)
    # Token-based estimate agrees for a queue of like-sized requests.
    assert estimator.estimate_wait_seconds(queued, queued * 50) == pytest.approx(
        queued / rate, rel=0.10
    )


def test_jittered_arrivals_still_converge() -> None:
    clock = FakeClock()
    rng = random.Random(3)
    estimator = ServiceRateEstimator(window_seconds=10.0, clock=clock)
    for _ in range(2000):
        clock.advance(rng.expovariate(50.0))
        estimator.record_completion(10)
    rps = estimator.requests_per_second()
    assert rps is not None and rps == pytest.approx(50.0, rel=0.10)


def test_fallback_before_any_measurement() -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(
        fallback_requests_per_second=4.0, fallback_tokens_per_second=100.0, clock=clock
    )
    assert estimator.requests_per_second() is None
    assert estimator.estimate_wait_seconds(8) == pytest.approx(2.0)
    assert estimator.estimate_wait_seconds(8, 1000) == pytest.approx(10.0)  # tokens dominate
    estimator.record_completion(10)  # one completion is no rate yet
    assert estimator.requests_per_second() is None


def test_tokens_dominate_when_the_queue_holds_long_requests() -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(clock=clock)
    _steady(clock, estimator, rate=10.0, seconds=20.0, tokens_each=100)  # 1000 tok/s
    # Five queued requests, but 20 000 tokens of work: 20 s, not 0.5 s.
    assert estimator.estimate_wait_seconds(5, 20_000) == pytest.approx(20.0, rel=0.10)


def test_a_stalled_engine_raises_the_estimate_and_idle_restarts_measurement() -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(window_seconds=10.0, clock=clock)
    _steady(clock, estimator, rate=10.0, seconds=20.0)
    before = estimator.estimate_wait_seconds(10)
    clock.advance(5.0)  # nothing completes
    assert estimator.estimate_wait_seconds(10) > before * 1.5
    clock.advance(60.0)  # idle past the window: back to the fallback
    assert estimator.requests_per_second() is None
    _steady(clock, estimator, rate=100.0, seconds=1.0)  # a fresh busy spell
    assert estimator.requests_per_second() == pytest.approx(100.0, rel=0.05)


def test_retry_after_is_clamped_and_rounded_up() -> None:
    clock = FakeClock()
    estimator = ServiceRateEstimator(
        fallback_requests_per_second=10.0, max_retry_after_seconds=30.0, clock=clock
    )
    assert estimator.retry_after_seconds(0) == 1.0
    assert estimator.retry_after_seconds(25) == pytest.approx(2.5)
    assert estimator.retry_after_seconds(10_000) == 30.0
    assert retry_after_header_value(0.0) == 1
    assert retry_after_header_value(2.5) == 3
    assert retry_after_header_value(2.0000000000000004) == 2
    assert retry_after_header_value(500.0, max_seconds=60.0) == 60
    assert retry_after_header_value(float("nan")) == 1


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError, match="window_seconds"):
        ServiceRateEstimator(window_seconds=0.0)
    with pytest.raises(ValueError, match="fallback_requests_per_second"):
        ServiceRateEstimator(fallback_requests_per_second=0.0)
