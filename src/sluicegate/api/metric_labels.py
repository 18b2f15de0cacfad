"""Every labelled metric at zero from start-up, for every label value it can take.

A counter whose label value never occurred is absent from ``/metrics``, and a dashboard
or alert on it sees "no data" rather than 0 (``rate()`` of a series that appears at its
first event misses that event).  The owners of each vocabulary say what the values are;
this module, above them all, declares them on the app's registry.
"""

from __future__ import annotations

from sluicegate.admission.decision import RejectReason
from sluicegate.api.resume import RESUME_STATUSES
from sluicegate.config import Settings
from sluicegate.metrics.registry import Metrics
from sluicegate.pipeline.pipelines import stage_label_values
from sluicegate.scheduler.scheduler import PreemptReason
from sluicegate.service.records import REQUEST_STATUSES
from sluicegate.store.records import StoreFailureMode, degraded_operation_labels
from sluicegate.stream.session import CHECKPOINT_REASONS
from sluicegate.types import PriorityClass


def declare_label_values(metrics: Metrics, settings: Settings) -> None:
    """Create each known series of ``metrics`` (counters at 0, histograms empty)."""
    for reason in RejectReason:
        metrics.rejections_total.labels(reason.value)
    for preempt in PreemptReason:
        metrics.preemptions_total.labels(preempt.value)
    for status in REQUEST_STATUSES:
        metrics.requests_total.labels(status)
    for result in ("query", "hit"):
        metrics.prefix_cache_tokens_total.labels(result)
    for status in RESUME_STATUSES:
        metrics.stream_resumes_total.labels(status)
    for stage in stage_label_values(settings.pipelines):
        metrics.stream_pauses_total.labels(stage)
        metrics.streams_paused.labels(stage).set(0)
        metrics.stream_buffer_tokens.labels(stage)
    for pipeline in settings.pipelines:
        metrics.retrieval_seconds.labels(pipeline.name)
        metrics.guard_check_seconds.labels(pipeline.name)
    for checkpoint in CHECKPOINT_REASONS:
        metrics.streams_checkpointed_total.labels(checkpoint)
    for priority in PriorityClass:
        for histogram in (
            metrics.time_to_first_token_seconds,
            metrics.e2e_request_latency_seconds,
            metrics.queue_wait_seconds,
            metrics.ttft_prediction_error_seconds,
        ):
            histogram.labels(priority.value)
        metrics.requests_waiting.labels(priority.value).set(0)
    if settings.store != "memory":  # the in-process store is never unreachable
        mode = StoreFailureMode(settings.store_failure_mode)
        for operation, outcome in degraded_operation_labels(mode):
            metrics.store_degraded_operations_total.labels(operation, outcome.value)
