from __future__ import annotations

import math

import pytest

from sluicegate.store.token_bucket import TokenBucket
from tests.fake_clock import FakeClock


@pytest.mark.parametrize(("rate", "burst"), [(10.0, 5.0), (0.5, 1.0), (3.0, 7.0), (1000.0, 64.0)])
def test_a_burst_admits_exactly_burst_requests(rate: float, burst: float) -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock)
    admitted = sum(bucket.try_acquire(1).admitted for _ in range(100))
    assert admitted == int(burst)


def test_retry_after_is_the_exact_time_until_tokens_are_there() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_second=4.0, burst=10.0, clock=clock)
    assert bucket.try_acquire(8).admitted
    refused = bucket.try_acquire(5)
    assert not refused.admitted
    assert refused.remaining == pytest.approx(2.0)
    assert refused.retry_after_seconds == pytest.approx(3 / 4)  # 3 missing at 4 per second
    assert refused.reset_seconds == pytest.approx(8 / 4)
    clock.advance(refused.retry_after_seconds)
    got = bucket.try_acquire(5)
    assert got.admitted
    assert got.retry_after_seconds == 0.0
    assert got.remaining == pytest.approx(0.0)


def test_refill_over_time_admits_rate_per_second_and_never_exceeds_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_second=10.0, burst=5.0, clock=clock)
    while bucket.try_acquire(1).admitted:
        pass
    # Ten seconds in steps of 0.1 s: one token per step, admitted every time.
    admitted = 0
    for _ in range(100):
        clock.advance(0.1)
        admitted += bucket.try_acquire(1).admitted
        assert not bucket.try_acquire(1).admitted
    assert admitted == 100
    clock.advance(3600.0)
    assert bucket.available() == pytest.approx(5.0)
    assert sum(bucket.try_acquire(1).admitted for _ in range(10)) == 5


def test_float_noise_in_time_deltas_does_not_lose_a_token() -> None:
    clock = FakeClock(0.0)
    bucket = TokenBucket(rate_per_second=10.0, burst=1.0, clock=clock)
    assert bucket.try_acquire(1).admitted
    for t in (0.1, 0.2, 0.30000000000000004, 0.4, 0.5, 0.6, 0.7, 0.7999999999999999):
        clock.now = t
        assert bucket.try_acquire(1).admitted, t


def test_a_request_larger_than_the_burst_says_so() -> None:
    bucket = TokenBucket(rate_per_second=100.0, burst=50.0, clock=FakeClock())
    refused = bucket.try_acquire(51)
    assert not refused.admitted
    assert refused.exceeds_burst
    assert math.isinf(refused.retry_after_seconds)
    assert bucket.available() == 50.0  # nothing taken
    assert bucket.try_acquire(50).admitted  # exactly the burst is fine
    assert not bucket.try_acquire(1).exceeds_burst


def test_reconciliation_refund_and_charge_into_debt() -> None:
    clock = FakeClock()
    # 600 tokens per minute = 10 per second.
    bucket = TokenBucket(rate_per_second=10.0, burst=600.0, clock=clock)
    assert bucket.try_acquire(500).admitted  # prompt + max_tokens reserved
    bucket.refund(500 - 120)  # the request really used 120
    assert bucket.available() == pytest.approx(480.0)
    bucket.refund(10_000)
    assert bucket.available() == 600.0  # never above the burst

    assert bucket.try_acquire(600).admitted
    bucket.charge(100)  # used 100 more than reserved: debt
    assert bucket.available() == pytest.approx(-100.0)
    refused = bucket.try_acquire(1)
    assert not refused.admitted
    assert refused.retry_after_seconds == pytest.approx(101 / 10)  # repay, then one token
    clock.advance(10.0)
    assert bucket.available() == pytest.approx(0.0)
    clock.advance(0.1)
    assert bucket.try_acquire(1).admitted


def test_peek_and_reset_seconds() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_second=2.0, burst=4.0, clock=clock)
    assert bucket.peek() == (4.0, 0.0)
    bucket.try_acquire(3)
    assert bucket.peek() == pytest.approx((1.0, 1.5))
    clock.advance(1.0)
    assert bucket.reset_seconds() == pytest.approx(0.5)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.inf, 1.0)])
def test_invalid_parameters(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        TokenBucket(rate, burst, FakeClock())
