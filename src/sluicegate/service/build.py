"""The stages built from the settings: engine and scheduler, admission, the queue."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sluicegate.admission.breaker import BreakerConfig, CircuitBreaker, Threshold
from sluicegate.admission.controller import AdmissionConfig, AdmissionController
from sluicegate.admission.limits import BucketFactory
from sluicegate.admission.objectives import (
    AUTO_TTFT_FLOOR_SECONDS,
    Objectives,
    auto_ttft_seconds,
)
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.slo import (
    SLOAdmission,
    TTFTPredictor,
)
from sluicegate.admission.tenants import Tenant, TenantRegistry
from sluicegate.config import Settings
from sluicegate.errors import APIError
from sluicegate.queue.fair_queue import FairQueueConfig
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.store.errors import StoreUnavailable
from sluicegate.types import PriorityClass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Admission:
    """Who may enter, and the measured service rate behind every ``Retry-After``."""

    tenants: TenantRegistry
    controller: AdmissionController
    estimator: ServiceRateEstimator
    breaker: CircuitBreaker | None


def apply_pace(
    settings: Settings, tenant: Tenant, request: Request, max_tokens_per_second: float | None
) -> None:
    """A request's pace: its cap (the request's or its tenant's ``max_tokens_per_second``,
    the lower of the two) and its readers' declared pace (the tenant's)."""
    pace = max_tokens_per_second or tenant.max_tokens_per_second
    if tenant.max_tokens_per_second and max_tokens_per_second:
        pace = min(max_tokens_per_second, tenant.max_tokens_per_second)
    if pace:
        # Never below the floor (checked at the front door; a stream continued from an
        # older replica's log is held to it too).
        pace = max(pace, settings.pace_floor_tokens_per_second)
        request.pace.min_token_interval_seconds = 1.0 / pace
    request.pace.reading_tokens_per_second = tenant.reading_tokens_per_second


def prefix_namespace(settings: Settings, tenant: str) -> str:
    """Whose cached prefixes a tenant's requests may reuse: everyone's (""), or with
    ``prefix_cache_scope: tenant`` only its own."""
    return tenant if settings.prefix_cache_scope == "tenant" else ""


def objectives(settings: Settings) -> dict[PriorityClass, Objectives]:
    """Each class's objectives.  An automatic TTFT objective starts at its floor: the cost
    model knows nothing before the warm-up, after which :func:`resolve_auto_objective`
    sizes it."""
    ttft = settings.ttft_objective_seconds or AUTO_TTFT_FLOOR_SECONDS
    return {
        PriorityClass.INTERACTIVE: Objectives(ttft, settings.tpot_slo_ms / 1000.0),
        PriorityClass.BATCH: Objectives(
            settings.batch_ttft_slo_ms / 1000.0, settings.batch_tpot_slo_ms / 1000.0
        ),
    }


def build_slo(settings: Settings, estimate: Callable[[], ServiceEstimate]) -> SLOAdmission | None:
    """Admission by objective (None under static admission), predicting with what
    ``estimate`` says the engine sustains now."""
    if settings.admission != "slo":
        return None
    predictor = TTFTPredictor(
        estimate,
        time.monotonic,
        max_retry_after_seconds=settings.max_retry_after_seconds,
    )
    return SLOAdmission(predictor, objectives(settings))


def resolve_auto_objective(
    settings: Settings, estimate: ServiceEstimate, slo: SLOAdmission | None
) -> float | None:
    """After the warm-up: size an automatic TTFT objective from the calibrated cost model.
    Returns it (None when the objective is configured or admission is static)."""
    if slo is None or settings.ttft_objective_seconds is not None:
        return None
    seconds = auto_ttft_seconds(estimate)
    interactive = slo.objectives[PriorityClass.INTERACTIVE]
    slo.objectives[PriorityClass.INTERACTIVE] = replace(interactive, ttft_seconds=seconds)
    return seconds


def build_admission(settings: Settings, bucket_factory: BucketFactory | None) -> Admission:
    """``bucket_factory`` makes the tenants' rate-limit buckets (``Store.bucket``), so that
    every replica sharing the store enforces the same limits."""
    tenants = TenantRegistry(settings.tenants)
    estimator = ServiceRateEstimator(max_retry_after_seconds=settings.max_retry_after_seconds)
    breaker = (
        CircuitBreaker(
            BreakerConfig(
                queue_wait_shed_batch=_threshold(settings.breaker_queue_wait_shed_seconds),
                queue_wait_open=_threshold(settings.breaker_queue_wait_open_seconds),
                step_shed_batch=_threshold(settings.breaker_step_shed_seconds),
                step_open=_threshold(settings.breaker_step_open_seconds),
                min_dwell_seconds=settings.breaker_min_dwell_seconds,
            )
        )
        if settings.breaker
        else None
    )
    controller = AdmissionController(
        tenants,
        AdmissionConfig(
            max_concurrent_requests=settings.max_concurrent_requests,
            open_max_in_flight=settings.max_num_seqs,
            max_retry_after_seconds=settings.max_retry_after_seconds,
        ),
        breaker=breaker,
        estimator=estimator,
        bucket_factory=bucket_factory,
    )
    return Admission(tenants, controller, estimator, breaker)


def queue_config(settings: Settings) -> FairQueueConfig:
    return FairQueueConfig.uniform(
        settings.max_queued_requests,
        settings.max_queued_tokens,
        settings.queue_policy,
        batch_policy=settings.batch_queue_policy,
    )


def _threshold(enter_seconds: float) -> Threshold:
    return Threshold(enter_seconds, enter_seconds / 2)


def log_auto_objective(seconds: float | None) -> None:
    """Say what an automatic TTFT objective came to (None: it is configured)."""
    if seconds is not None:
        logger.info(
            "interactive TTFT objective (auto): %.0f ms, twice a 256-token prompt's time "
            "to first token on the idle engine; set ttft_slo_ms to choose it",
            seconds * 1e3,
        )


def store_refusal(error: StoreUnavailable) -> APIError:
    """The 503 of a request refused because the shared store is down (fail_closed)."""
    return APIError(
        503,
        f"The shared store is unreachable, so limits and stream logs cannot be kept "
        f"({error}); store_failure_mode is fail_closed. Retry shortly.",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )
