from __future__ import annotations

import random

import pytest

from sluicegate.admission.breaker import BreakerConfig, BreakerState, CircuitBreaker
from sluicegate.admission.controller import AdmissionConfig, AdmissionController, Admitted
from sluicegate.admission.decision import Rejection, RejectReason
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.tenants import Tenant, TenantConfig, TenantRegistry
from sluicegate.types import PriorityClass
from tests.fake_clock import FakeClock

INTERACTIVE = PriorityClass.INTERACTIVE
BATCH = PriorityClass.BATCH


def _registry(**limits: float | int | None) -> TenantRegistry:
    return TenantRegistry([TenantConfig(name="t", api_key="k", **limits)])


def _tenant(registry: TenantRegistry) -> Tenant:
    tenant = registry.get("t")
    assert tenant is not None
    return tenant


def _admitted(outcome: Admitted | Rejection) -> Admitted:
    assert isinstance(outcome, Admitted), outcome
    return outcome


def _rejected(outcome: Admitted | Rejection, reason: RejectReason) -> Rejection:
    assert isinstance(outcome, Rejection), outcome
    assert outcome.reason is reason, outcome
    return outcome


def _tripped_breaker(clock: FakeClock, queue_wait_seconds: float) -> CircuitBreaker:
    breaker = CircuitBreaker(BreakerConfig(min_samples=1, evaluate_interval_seconds=0.0), clock)
    breaker.record_queue_wait(queue_wait_seconds)
    return breaker


def test_draining_comes_first() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=1.0)
    controller = AdmissionController(registry, breaker=_tripped_breaker(clock, 60.0), clock=clock)
    controller.start_draining()
    refused = _rejected(controller.admit(_tenant(registry), BATCH, 1, 1), RejectReason.DRAINING)
    assert refused.http_status == 503 and "shutting down" in refused.message
    controller.stop_draining()
    assert not controller.draining


def test_breaker_comes_before_the_buckets_and_takes_nothing() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=1.0, tokens_per_minute=600)
    breaker = _tripped_breaker(clock, 3.0)  # SHED_BATCH
    controller = AdmissionController(registry, breaker=breaker, clock=clock)
    tenant = _tenant(registry)
    refused = _rejected(controller.admit(tenant, BATCH, 10, 10), RejectReason.CIRCUIT_OPEN)
    assert refused.http_status == 503 and "batch-class" in refused.message
    assert refused.retry_after_seconds == pytest.approx(5.0)
    limits = controller.rate_limits(tenant)
    assert limits.remaining_requests == 1 and limits.remaining_tokens == 600
    # Interactive still goes through while only batch is shed.
    _admitted(controller.admit(tenant, INTERACTIVE, 10, 10))


def test_open_breaker_admits_interactive_only_below_capacity() -> None:
    clock = FakeClock()
    registry = TenantRegistry()
    breaker = _tripped_breaker(clock, 60.0)
    controller = AdmissionController(
        registry,
        AdmissionConfig(max_concurrent_requests=8, open_max_in_flight=2),
        breaker=breaker,
        clock=clock,
    )
    assert breaker.state is BreakerState.OPEN
    tenant = registry.authenticate(None)
    held = [_admitted(controller.admit(tenant, INTERACTIVE, 1, 1)) for _ in range(2)]
    refused = _rejected(controller.admit(tenant, INTERACTIVE, 1, 1), RejectReason.CIRCUIT_OPEN)
    assert "circuit breaker open" in refused.message
    held[0].release(1, 1)
    _admitted(controller.admit(tenant, INTERACTIVE, 1, 1))


def test_request_bucket_then_token_bucket() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=2.0, tokens_per_minute=600)
    controller = AdmissionController(registry, clock=clock)
    tenant = _tenant(registry)
    for _ in range(2):
        _admitted(controller.admit(tenant, None, 100, 100)).release(100, 100)
    refused = _rejected(controller.admit(tenant, None, 1, 1), RejectReason.RATE_LIMITED_REQUESTS)
    assert refused.http_status == 429
    assert refused.retry_after_seconds == pytest.approx(0.5)
    assert "requests_per_second limit of 2" in refused.message
    assert refused.headers()["retry-after"] == "1"
    assert refused.headers()["x-ratelimit-remaining-requests"] == "0"
    assert controller.rate_limits(tenant).remaining_tokens == 200  # token bucket untouched

    clock.advance(0.5)
    refused = _rejected(controller.admit(tenant, None, 100, 200), RejectReason.RATE_LIMITED_TOKENS)
    assert refused.http_status == 429
    # 300 wanted, 205 there (5 refilled in 0.5 s at 10/s): 95 missing at 10/s.
    assert refused.retry_after_seconds == pytest.approx(9.5)
    assert "tokens_per_minute limit of 600" in refused.message
    # The request token taken on the way is given back.
    assert controller.rate_limits(tenant).remaining_requests == 1


def test_a_request_larger_than_the_token_limit_is_a_400_without_retry() -> None:
    registry = _registry(tokens_per_minute=1000)
    controller = AdmissionController(registry, clock=FakeClock())
    refused = _rejected(
        controller.admit(_tenant(registry), None, 600, 500), RejectReason.RATE_LIMITED_TOKENS
    )
    assert refused.http_status == 400
    assert refused.error_code == "request_too_large"
    assert refused.retry_after_seconds is None and "retry-after" not in refused.headers()
    assert "600" in refused.message and "1100 tokens exceeds" in refused.message


def test_concurrency_caps_refund_the_buckets() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=10.0, tokens_per_minute=6000, max_concurrent=1)
    estimator = ServiceRateEstimator(fallback_requests_per_second=0.25, clock=clock)
    controller = AdmissionController(registry, estimator=estimator, clock=clock)
    tenant = _tenant(registry)
    held = _admitted(controller.admit(tenant, None, 100, 100))
    before = controller.rate_limits(tenant)
    refused = _rejected(controller.admit(tenant, None, 100, 100), RejectReason.CONCURRENCY)
    assert refused.http_status == 429 and "max_concurrent limit of 1" in refused.message
    assert refused.retry_after_seconds == 4.0  # one completion at the fallback rate
    after = controller.rate_limits(tenant)
    assert (after.remaining_requests, after.remaining_tokens) == (
        before.remaining_requests,
        before.remaining_tokens,
    )
    held.release(100, 100)
    _admitted(controller.admit(tenant, None, 100, 100))


def test_global_concurrency_comes_last() -> None:
    registry = TenantRegistry(
        [TenantConfig(name="a", api_key="ka"), TenantConfig(name="b", api_key="kb")]
    )
    controller = AdmissionController(registry, AdmissionConfig(max_concurrent_requests=2))
    a, b = registry.authenticate("Bearer ka"), registry.authenticate("Bearer kb")
    _admitted(controller.admit(a, None, 1, 1))
    _admitted(controller.admit(b, None, 1, 1))
    refused = _rejected(controller.admit(a, None, 1, 1), RejectReason.CONCURRENCY)
    assert "max_concurrent_requests limit of 2" in refused.message
    assert controller.in_flight == 2
    assert controller.tenant_in_flight("a") == 1  # the tenant slot was given back


def test_release_reconciles_tokens_and_frees_slots_exactly_once() -> None:
    clock = FakeClock()
    registry = _registry(tokens_per_minute=6000, max_concurrent=2)
    controller = AdmissionController(
        registry, AdmissionConfig(max_concurrent_requests=5), clock=clock
    )
    tenant = _tenant(registry)
    admitted = _admitted(controller.admit(tenant, None, 1000, 2000))
    assert admitted.reserved_tokens == 3000
    assert admitted.headers()["x-ratelimit-remaining-tokens"] == "3000"
    assert controller.in_flight == 1 and controller.tenant_in_flight("t") == 1

    assert admitted.release(1000, 500) is True  # 1500 unused: refunded
    assert controller.rate_limits(tenant).remaining_tokens == 4500
    assert controller.in_flight == 0 and controller.tenant_in_flight("t") == 0
    assert admitted.release(1000, 500) is False
    assert admitted.handle.release(0, 0) is False
    assert controller.rate_limits(tenant).remaining_tokens == 4500
    assert controller.in_flight == 0 and admitted.handle.released

    # Using more than reserved puts the bucket in debt.
    over = _admitted(controller.admit(tenant, None, 100, 100))
    over.release(3000, 3000)
    assert controller.rate_limits(tenant).remaining_tokens == 0
    assert controller.rate_limits(tenant).reset_tokens_seconds == pytest.approx(7500 / 100)


def test_open_mode_and_unlisted_tenants() -> None:
    registry = TenantRegistry()
    controller = AdmissionController(registry)
    default = registry.authenticate("Bearer anything")
    admitted = _admitted(controller.admit(default, None, 5, 5))
    assert admitted.priority_class is INTERACTIVE
    assert admitted.headers() == {}
    custom = Tenant("elsewhere", priority_class=BATCH, requests_per_second=1.0)
    outcome = _admitted(controller.admit(custom, None, 1, 1))
    assert outcome.priority_class is BATCH
    _rejected(controller.admit(custom, None, 1, 1), RejectReason.RATE_LIMITED_REQUESTS)


def test_retry_after_is_clamped() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=0.001)
    controller = AdmissionController(
        registry, AdmissionConfig(max_retry_after_seconds=30.0), clock=clock
    )
    tenant = _tenant(registry)
    _admitted(controller.admit(tenant, None, 1, 1))
    refused = _rejected(controller.admit(tenant, None, 1, 1), RejectReason.RATE_LIMITED_REQUESTS)
    assert refused.retry_after_seconds == 30.0
    assert refused.message.endswith("Retry after 30.00s.")
    assert refused.headers()["x-ratelimit-reset-requests"] == "16m40s"


def test_random_traffic_never_leaks_capacity() -> None:
    rng = random.Random(5)
    clock = FakeClock()
    registry = TenantRegistry(
        [
            TenantConfig(
                name=f"t{i}",
                api_key=f"k{i}",
                requests_per_second=50.0,
                tokens_per_minute=60_000,
                max_concurrent=3,
            )
            for i in range(3)
        ]
    )
    controller = AdmissionController(
        registry, AdmissionConfig(max_concurrent_requests=6), clock=clock
    )
    tenants = registry.tenants
    held: list[Admitted] = []
    for _ in range(5000):
        clock.advance(rng.random() * 0.01)
        if rng.random() < 0.6:
            outcome = controller.admit(rng.choice(tenants), None, rng.randint(1, 200), 100)
            if isinstance(outcome, Admitted):
                held.append(outcome)
        elif held:
            victim = held.pop(rng.randrange(len(held)))
            victim.release(victim.reserved_tokens // 2, rng.randint(0, 100))
            victim.release(1, 1)  # a second release is a no-op
        assert controller.in_flight == len(held) <= 6
        for tenant in tenants:
            assert 0 <= controller.tenant_in_flight(tenant.name) <= 3
    for admitted in held:
        admitted.release(0, 0)
    assert controller.in_flight == 0
    assert all(controller.tenant_in_flight(t.name) == 0 for t in tenants)


def test_a_request_burst_admits_that_many_at_once_then_the_rate_applies() -> None:
    clock = FakeClock()
    registry = _registry(requests_per_second=0.5, request_burst=3)
    controller = AdmissionController(registry, clock=clock)
    tenant = _tenant(registry)
    for _ in range(3):
        _admitted(controller.admit(tenant, INTERACTIVE, 1, 1)).release(1, 1)
    refused = _rejected(
        controller.admit(tenant, INTERACTIVE, 1, 1), RejectReason.RATE_LIMITED_REQUESTS
    )
    assert refused.retry_after_seconds == pytest.approx(2.0)  # one request at 0.5/s
    assert "(burst 3)" in refused.message
    clock.advance(2.0)
    _admitted(controller.admit(tenant, INTERACTIVE, 1, 1))
