"""OpenTelemetry tracing, off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (or a test
installs its own provider).

One span per request with child spans ``queue`` (arrival to dispatch), ``prefill``
(dispatch to first token) and ``decode`` (first token to the end), created when the
request finishes from the timestamps it recorded, so tracing adds no work per token.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode, Tracer

_tracer: Tracer | None = None


def setup_tracing(service_name: str = "sluicegate") -> bool:
    """Export spans over OTLP/HTTP when the standard env var asks for it."""
    global _tracer
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("sluicegate")
    return True


def use_tracer(tracer: Tracer | None) -> None:
    """Install a tracer (tests use the SDK's in-memory exporter); ``None`` turns it off."""
    global _tracer
    _tracer = tracer


@dataclass(slots=True, frozen=True)
class RequestTimeline:
    """Monotonic timestamps of one request's phases (``None``: it never got there)."""

    request_id: str
    tenant: str
    status: str
    arrival: float
    dispatched: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    output_tokens: int


def record_request_spans(timeline: RequestTimeline) -> None:
    tracer = _tracer
    if tracer is None:
        return
    # Spans take wall-clock nanoseconds; convert from the monotonic clock once.
    offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(t: float) -> int:
        return int(t * 1e9) + offset_ns

    root = tracer.start_span(
        "sluicegate.request",
        start_time=ns(timeline.arrival),
        attributes={
            "sluicegate.request_id": timeline.request_id,
            "sluicegate.tenant": timeline.tenant,
            "sluicegate.status": timeline.status,
            "gen_ai.usage.input_tokens": timeline.prompt_tokens,
            "gen_ai.usage.output_tokens": timeline.output_tokens,
        },
    )
    context = trace.set_span_in_context(root)
    end_queue = timeline.dispatched if timeline.dispatched is not None else timeline.finished
    tracer.start_span("queue", context=context, start_time=ns(timeline.arrival)).end(ns(end_queue))
    if timeline.dispatched is not None:
        end_prefill = timeline.first_token or timeline.finished
        tracer.start_span("prefill", context=context, start_time=ns(timeline.dispatched)).end(
            ns(end_prefill)
        )
    if timeline.first_token is not None:
        tracer.start_span("decode", context=context, start_time=ns(timeline.first_token)).end(
            ns(timeline.finished)
        )
    if timeline.status in ("error", "evicted"):
        root.set_status(Status(StatusCode.ERROR, timeline.status))
    root.end(ns(timeline.finished))
