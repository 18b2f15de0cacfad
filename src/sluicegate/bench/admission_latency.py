"""How much a refusal costs: :meth:`AdmissionController.admit` latency per rejection.

For the docs, not for tests (tests assert behaviour, not speed)::

    python -m sluicegate.bench.admission_latency
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sluicegate.admission.breaker import BreakerConfig, CircuitBreaker, Threshold
from sluicegate.admission.controller import AdmissionController, Admitted
from sluicegate.admission.decision import Rejection, RejectReason
from sluicegate.admission.tenants import TenantConfig, TenantRegistry
from sluicegate.types import PriorityClass


@dataclass(slots=True, frozen=True)
class RejectionLatency:
    """Best-of-``repeats`` mean microseconds per call, by path."""

    iterations: int
    microseconds_by_path: dict[str, float]

    def to_markdown(self) -> str:
        rows = [f"| {path} | {us:.2f} |" for path, us in self.microseconds_by_path.items()]
        return "\n".join(["| path | µs per call |", "|---|---|", *rows])


def _best_mean_us(call: Callable[[], object], iterations: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(iterations):
            call()
        best = min(best, (time.perf_counter_ns() - start) / iterations / 1000.0)
    return best


def measure_rejection_latency(iterations: int = 100_000, repeats: int = 5) -> RejectionLatency:
    """Time ``admit`` refusing, per reason, plus an admit + release for comparison."""
    registry = TenantRegistry(
        [
            TenantConfig(name="limited", api_key="k-limited", requests_per_second=1.0),
            TenantConfig(name="tokens", api_key="k-tokens", tokens_per_minute=100.0),
            TenantConfig(name="free", api_key="k-free"),
        ]
    )
    limited = registry.get("limited")
    tokens = registry.get("tokens")
    free = registry.get("free")
    assert limited is not None and tokens is not None and free is not None

    controller = AdmissionController(registry)
    # Empty the one-request burst and the whole token bucket (refill: 57 s for 95 tokens).
    for tenant, prompt_tokens, max_tokens in ((limited, 10, 10), (tokens, 50, 50)):
        held = controller.admit(tenant, None, prompt_tokens, max_tokens)
        assert isinstance(held, Admitted)

    draining = AdmissionController(registry)
    draining.start_draining()

    breaker = CircuitBreaker(
        BreakerConfig(queue_wait_shed_batch=Threshold(0.1, 0.05), min_samples=1)
    )
    breaker.record_queue_wait(1.0)
    shedding = AdmissionController(registry, breaker=breaker)

    def expect(reason: RejectReason, outcome: Admitted | Rejection) -> None:
        if not isinstance(outcome, Rejection) or outcome.reason is not reason:
            raise AssertionError(f"expected a {reason} rejection, got {outcome!r}")

    expect(RejectReason.RATE_LIMITED_REQUESTS, controller.admit(limited, None, 10, 10))
    expect(RejectReason.RATE_LIMITED_TOKENS, controller.admit(tokens, None, 10, 95))
    expect(RejectReason.DRAINING, draining.admit(free, None, 10, 10))
    expect(RejectReason.CIRCUIT_OPEN, shedding.admit(free, PriorityClass.BATCH, 10, 10))

    def admit_and_release() -> None:
        outcome = controller.admit(free, None, 10, 10)
        assert isinstance(outcome, Admitted)
        outcome.release(10, 10)

    paths: dict[str, Callable[[], object]] = {
        "rejected: draining": lambda: draining.admit(free, None, 10, 10),
        "rejected: circuit_open (batch shed)": lambda: shedding.admit(
            free, PriorityClass.BATCH, 10, 10
        ),
        "rejected: rate_limited_requests": lambda: controller.admit(limited, None, 10, 10),
        "rejected: rate_limited_tokens": lambda: controller.admit(tokens, None, 10, 95),
        "admitted + released": admit_and_release,
    }
    return RejectionLatency(
        iterations,
        {name: _best_mean_us(call, iterations, repeats) for name, call in paths.items()},
    )


if __name__ == "__main__":
    print(measure_rejection_latency().to_markdown())
