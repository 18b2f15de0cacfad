"""What a finished request leaves behind: metrics, recent latencies, a log line and spans."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from sluicegate.admission.slo import SLOAdmission
from sluicegate.metrics.registry import Metrics
from sluicegate.metrics.request_log import request_logger
from sluicegate.metrics.tracing import RequestTimeline, record_request_spans
from sluicegate.metrics.window import SlidingWindow
from sluicegate.service.generation import Generation
from sluicegate.types import PriorityClass

#: Every ``status`` a request can end with (the ``requests_total{status}`` label values):
#: OpenAI's finish reasons, an engine ``error``, ``cancelled`` (the client went away or
#: cancelled, or its detached stream's grace ran out), ``evicted`` (it stopped reading),
#: ``drained`` (stopped by a shutdown) and ``moved`` (another replica continues it).
REQUEST_STATUSES = (
    "stop",
    "length",
    "content_filter",
    "tool_calls",
    "error",
    "refused",
    "cancelled",
    "evicted",
    "drained",
    "moved",
)


@dataclass(slots=True)
class LatencyWindows:
    """Recent per-request latencies, for ``/v1/stats``."""

    ttft: SlidingWindow = field(default_factory=SlidingWindow)
    tpot: SlidingWindow = field(default_factory=SlidingWindow)
    queue_wait: SlidingWindow = field(default_factory=SlidingWindow)
    ttfmt: SlidingWindow = field(default_factory=SlidingWindow)
    qoe: SlidingWindow = field(default_factory=SlidingWindow)


def record_delivery(
    metrics: Metrics,
    generation: Generation,
    num_tokens: int,
    slo: SLOAdmission | None,
    text: str = "",
    reading_pace: float = 8.0,
) -> None:
    """Time to first token (and to the first meaningful one), inter-token gaps and tokens
    on time for their reader of one write to the client; the TTFT prediction's error
    teaches admission its margin."""
    before = generation.num_tokens_written
    ttft, gaps = generation.record_write(num_tokens)
    written = generation.last_write_time  # this write's time
    if num_tokens and written is not None and slo is not None:
        count_on_time(generation, before, num_tokens, written, slo, reading_pace)
    if (
        num_tokens
        and written is not None
        and generation.first_meaningful_time is None
        and (meaningful(text))
    ):
        generation.first_meaningful_time = written
        ttfmt = written - generation.request.arrival_time
        metrics.time_to_first_meaningful_token_seconds.labels(generation.priority_label).observe(
            ttfmt
        )
    if ttft is not None:
        metrics.time_to_first_token_seconds.labels(generation.priority_label).observe(ttft)
        ticket = generation.ticket
        if ticket is not None and ticket.predicted_ttft_seconds is not None:
            metrics.ttft_prediction_error_seconds.labels(generation.priority_label).observe(
                ttft - ticket.predicted_ttft_seconds
            )
            if slo is not None:
                raw = ticket.predicted_ttft_seconds - ticket.ttft_margin_seconds
                slo.predictor.observe_ttft(raw, ttft)
    for gap in gaps:
        metrics.inter_token_latency_seconds.observe(gap)


def count_on_time(
    generation: Generation,
    first: int,
    num_tokens: int,
    written: float,
    slo: SLOAdmission,
    reading_pace: float,
) -> None:
    """QoE's numerator (after Andes, as ``sluicegate bench`` scores it): token ``i`` of an
    interactive answer is on time if written by arrival + the TTFT objective + ``i / pace``,
    at its reader's pace (measured from its client, else declared, else the default)."""
    if generation.priority_label != PriorityClass.INTERACTIVE.value:
        return
    request = generation.request
    pace = request.pace.measured_tokens_per_second or request.pace.reading_tokens_per_second
    pace = pace or reading_pace
    objective = slo.objectives[PriorityClass.INTERACTIVE].ttft_seconds
    # On time: i >= (written - arrival - objective) * pace.
    earliest = math.ceil((written - request.arrival_time - objective) * pace - 1e-9)
    generation.num_tokens_on_time += max(0, first + num_tokens - max(first, earliest))


def meaningful(text: str) -> bool:
    """Text a reader takes in: a letter or a digit.  Whitespace, a role, markup (a code
    fence, list marks, ``#``, ``*``) and punctuation alone are not."""
    return any(ch.isalnum() for ch in text)


def record_end(
    metrics: Metrics, windows: LatencyWindows, generation: Generation, status: str
) -> None:
    """Per-request metrics, log line and spans of a request that ended with ``status``."""
    request = generation.request
    timing = generation.timing()
    priority = generation.priority_label
    metrics.requests_total.labels(status).inc()
    num_output_tokens = generation.num_output_tokens
    metrics.generation_tokens_total.inc(num_output_tokens - generation.num_resumed_tokens)
    metrics.e2e_request_latency_seconds.labels(priority).observe(timing["e2e_seconds"] or 0.0)
    if (queue_wait := timing["queue_wait_seconds"]) is not None:
        metrics.queue_wait_seconds.labels(priority).observe(queue_wait)
        windows.queue_wait.add(queue_wait)
    if (prefill := timing["prefill_seconds"]) is not None:
        metrics.prefill_seconds.observe(prefill)
    if (ttft := timing["ttft_seconds"]) is not None:
        windows.ttft.add(ttft)
    if (ttfmt := timing["ttfmt_seconds"]) is not None:
        windows.ttfmt.add(ttfmt)
    if generation.num_tokens_written and generation.priority_label == "interactive":
        qoe = generation.num_tokens_on_time / generation.num_tokens_written
        metrics.qoe.observe(qoe)
        windows.qoe.add(qoe)
    if (tpot := timing["tpot_seconds"]) is not None:
        metrics.time_per_output_token_seconds.observe(tpot)
        windows.tpot.add(tpot)
    ticket = generation.ticket
    tenant = ticket.tenant.name if ticket is not None else "default"
    request_logger().info(
        "request",
        request_id=generation.request_id,
        tenant=tenant,
        priority=priority,
        status=status,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=num_output_tokens,
        **timing,
        preemptions=request.num_preemptions,
    )
    record_request_spans(
        RequestTimeline(
            request_id=generation.request_id,
            tenant=tenant,
            status=status,
            arrival=request.arrival_time,
            dispatched=ticket.dispatched_at if ticket is not None else None,
            first_token=generation.stream.timings.first_token_time,
            finished=time.monotonic(),
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=num_output_tokens,
        )
    )
