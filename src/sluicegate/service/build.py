"""The stages built from the settings: engine and scheduler, admission, the queue."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sluicegate.admission.breaker import BreakerConfig, CircuitBreaker, Threshold
from sluicegate.admission.controller import AdmissionConfig, AdmissionController
from sluicegate.admission.limits import BucketFactory
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.slo import (
    AUTO_TTFT_FLOOR_SECONDS,
    Objectives,
    SLOAdmission,
    TTFTPredictor,
    auto_ttft_seconds,
)
from sluicegate.admission.tenants import Tenant, TenantRegistry
from sluicegate.config import Settings
from sluicegate.engine.factory import LoadedEngine
from sluicegate.errors import APIError
from sluicegate.queue.fair_queue import FairQueueConfig
from sluicegate.scheduler.pacing import PacingConfig, seat_objective_seconds
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
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


def build_scheduler(settings: Settings, loaded: LoadedEngine) -> Scheduler:
    """The scheduler for ``loaded``: its context is the smaller of the configured and the
    model's, and every capacity figure (slots, KV blocks) derives from it once, here."""
    pacing = PacingConfig(
        enabled=settings.scheduling == "qoe",
        reading_tokens_per_second=settings.reading_tokens_per_second,
        lead_seconds=settings.qoe_lead_seconds,
    )
    tpot = settings.tpot_slo_ms / 1000.0 if settings.admission == "slo" else None
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=min(settings.max_num_seqs, loaded.max_num_seqs),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=min(settings.max_model_len, loaded.max_model_len),
            kv_block_size=settings.kv_block_size,
            num_kv_blocks=settings.num_kv_blocks,
            prefix_caching=settings.prefix_caching,
            speculation=SpeculationConfig(
                num_tokens=speculative_tokens(settings), max_batch=settings.speculative_max_batch
            ),
            pause_preempt_seconds=pause_preempt_seconds(settings),
            pacing=pacing,
            tpot_objective_seconds=seat_objective_seconds(tpot, pacing),
        ),
        eos_token_ids=loaded.tokenizer.eos_token_ids,
    )


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
        request.min_token_interval_seconds = 1.0 / pace
    request.reading_tokens_per_second = tenant.reading_tokens_per_second


def speculative_tokens(settings: Settings) -> int:
    """Draft tokens a step may add: the setting on the embedded engine; on the sim engine
    only when set explicitly, because its text repeats, so drafts would be accepted far
    more often than on any model, and its timing (capacity planning, tests) would be too
    optimistic."""
    explicit = "speculative_tokens" in settings.model_fields_set
    return settings.speculative_tokens if settings.engine == "torch" or explicit else 0


def prefix_namespace(settings: Settings, tenant: str) -> str:
    """Whose cached prefixes a tenant's requests may reuse: everyone's (""), or with
    ``prefix_cache_scope: tenant`` only its own."""
    return tenant if settings.prefix_cache_scope == "tenant" else ""


def pause_preempt_seconds(settings: Settings) -> float | None:
    """When a paused sequence loses its KV: as configured; otherwise only when needed
    (admission by objective) or after 5 s (static admission, as before objectives)."""
    if not settings.pause:
        return None
    if settings.pause_preempt_seconds is not None:
        return settings.pause_preempt_seconds
    return None if settings.admission == "slo" else 5.0


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
