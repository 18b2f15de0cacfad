"""``/health``, ``/ready``, ``/metrics`` and ``/v1/stats``: what an operator sees."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from sluicegate.api.access import StatsViewer, require_admin, stats_viewer, visible_streams
from sluicegate.api.state import AppState, Ready, app_state, not_ready, store_down
from sluicegate.engine.base import CoreStats
from sluicegate.metrics.registry import Metrics
from sluicegate.types import PriorityClass

router = APIRouter()


def json_response(
    payload: object, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(payload),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )


@router.get("/health")
async def health() -> Response:
    return json_response({"status": "ok"})


@router.get("/ready")
async def ready(request: HTTPRequest) -> Response:
    state = app_state(request)
    if state.ready is None or state.draining or store_down(state):
        raise not_ready(state)
    return json_response({"status": "ready", "model": state.ready.service.model_name})


@router.get("/metrics")
async def metrics(request: HTTPRequest) -> Response:
    state = app_state(request)
    require_admin(state, request, "GET /metrics")
    refresh_state_metrics(state)
    # Rendering every series takes milliseconds (7 ms here for ~40 KB): off the event loop,
    # so a scrape does not hold up token writes and refusals meanwhile.
    body = await asyncio.to_thread(generate_latest, state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/stats")
async def stats(request: HTTPRequest) -> Response:
    state = app_state(request)
    viewer = stats_viewer(state, request)
    if state.ready is None:
        return json_response({"ready": False})
    return json_response(stats_body(state, state.ready, viewer))


def refresh_state_metrics(state: AppState) -> None:
    """Copy the engine's latest state into gauges and counters (at scrape time)."""
    metrics = state.metrics
    if state.store is not None:
        metrics.store_available.set(1 if state.store.available else 0)
    ready = state.ready
    if ready is None:
        return
    service = ready.service
    sched = service.core.stats()
    metrics.requests_running.set(sched.num_running)
    metrics.concurrency_limit.set(service.core.capacity.seat_limit)
    by_stage = ready.flow.paused_by_stage()
    held_by_stages = sum(n for stage, n in by_stage.items() if stage != "client")
    metrics.streams_paused.labels("client").set(max(0, sched.num_paused - held_by_stages))
    for stage in service.pipelines.stage_names:
        metrics.streams_paused.labels(stage).set(by_stage.get(stage, 0))
    queued = service.dispatcher.queued_by_class()
    for pc in PriorityClass:
        metrics.requests_waiting.labels(pc.value).set(
            sched.num_waiting_by_priority.get(pc.rank, 0) + queued.get(pc.value, 0)
        )
    if sched.kv_cache is not None:
        metrics.kv_cache_usage_ratio.set(sched.kv_cache.usage_ratio)
    if (prefix := sched.prefix_cache) is not None:
        counted = {
            "query": prefix["query_tokens"],
            "hit": prefix["hit_tokens"],
            "evictions": prefix["evictions"],
        }
        for key, value in counted.items():
            delta = value - state.counters_seen.get(key, 0)
            if delta > 0:
                counter = (
                    metrics.prefix_cache_evictions_total
                    if key == "evictions"
                    else (metrics.prefix_cache_tokens_total.labels(key))
                )
                counter.inc(delta)
                state.counters_seen[key] = value
        metrics.prefix_cache_cached_slots.set(prefix["cached_slots"])
    if (spec := sched.speculation) is not None:
        for outcome in ("proposed", "accepted"):
            key = f"speculative_{outcome}"
            delta = spec[f"{outcome}_tokens"] - state.counters_seen.get(key, 0)
            if delta > 0:
                metrics.speculative_tokens_total.labels(outcome).inc(delta)
                state.counters_seen[key] = spec[f"{outcome}_tokens"]
    if (pacing := sched.pacing) is not None:
        delta = pacing["yielded_sequence_steps"] - state.counters_seen.get("yielded", 0)
        if delta > 0:
            metrics.yielded_sequence_steps_total.inc(delta)
            state.counters_seen["yielded"] = pacing["yielded_sequence_steps"]
    prefill = sched.sections.get("prefill")
    if isinstance(prefill, dict):
        count_prefill(metrics, prefill, state.counters_seen)
    metrics.engine_up.labels(metrics.engine).set(1 if sched.engine_up else 0)
    # A copy first: the engine thread adds a reason the first time it preempts for it.
    for reason, count in dict(sched.preemptions_by_reason).items():
        seen = state.preemptions_seen.get(reason, 0)
        if count > seen:
            metrics.preemptions_total.labels(reason).inc(count - seen)
            state.preemptions_seen[reason] = count


def count_prefill(metrics: Metrics, prefill: dict[str, Any], seen: dict[str, float]) -> None:
    """The stall-free prefill counters of ``/v1/stats`` into Prometheus (``seen``: what
    was counted at the last scrape)."""
    counters = [
        (metrics.prefill_long_promoted_total, "promoted", prefill["long_promoted"]),
        (metrics.prefill_budget_limited_steps_total, "limited", prefill["budget_limited_steps"]),
    ]
    for lane, counts in prefill["lanes"].items():
        counter = metrics.prefill_lane_tokens_total.labels(lane)
        counters.append((counter, f"lane {lane}", counts["tokens"]))
    for phase, by_class in prefill["tokens_by_phase"].items():
        for priority, tokens in by_class.items():
            counter = metrics.scheduled_tokens_total.labels(phase, priority)
            counters.append((counter, f"{phase} {priority}", tokens))
    for counter, key, value in counters:
        if value > seen.get(key, 0):
            counter.inc(value - seen.get(key, 0))
            seen[key] = value


def stats_body(state: AppState, ready: Ready, viewer: StatsViewer) -> dict[str, object]:
    """Aggregate state for anyone allowed to read it; per-stream entries only as
    ``viewer`` may see them (:func:`sluicegate.api.access.visible_streams`)."""
    service = ready.service
    core = service.core.stats()
    dispatcher = service.dispatcher
    breaker = service.breaker
    latency = service.latency
    return {
        "ready": True,
        "model": service.model_name,
        "requests_running": core.num_running,
        "requests_waiting": core.num_waiting + dispatcher.num_queued,
        "kv_cache": kv_cache_section(core),
        "prefix_cache": core.prefix_cache,
        "engine_compile": core.compile_status,
        "prefill_requests": {**state.warmup_counts, "running": len(state.warmups)},
        "speculation": core.speculation,
        "scheduling": {"policy": service.settings.scheduling, **(core.pacing or {})},
        "requests_paused": core.num_paused,
        "requests_throttled": core.num_throttled,
        "streams_paused": ready.flow.num_paused,
        "streams_paused_by_stage": ready.flow.paused_by_stage(),
        "pipelines": service.pipelines.snapshot(),
        "streams_scope": viewer.scope.value,
        "streams": visible_streams(ready, viewer),
        "preemptions_total": core.num_preemptions_total,
        "preemptions_by_reason": core.preemptions_by_reason,
        "queue": {
            "queued": dispatcher.num_queued,
            "queued_by_class": dispatcher.queued_by_class(),
            "service_rate_requests_per_second": service.estimator.requests_per_second(),
            "service_rate_tokens_per_second": service.estimator.tokens_per_second(),
        },
        "breaker_state": breaker.state.label if breaker is not None else "disabled",
        "rejections_by_reason": {
            sample.labels["reason"]: sample.value
            for metric in state.metrics.rejections_total.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        },
        "admission": {
            "mode": service.settings.admission,
            "ttft_objective": service.settings.ttft_slo_ms if service.slo else None,
            "objectives": {
                pc.value: {"ttft_seconds": o.ttft_seconds, "tpot_seconds": o.tpot_seconds}
                for pc, o in (service.slo.objectives.items() if service.slo else ())
            },
            **(service.slo.predictor.snapshot() if service.slo else {}),
        },
        **core.sections,
        "engine_steps_total": core.num_steps,
        "batch_size": core.batch_size,
        "live_requests": len(service.generations),
        "latency_window_seconds": latency.ttft.window_seconds,
        "ttft_seconds": latency.ttft.percentiles(0.5, 0.95, 0.99),
        "ttfmt_seconds": latency.ttfmt.percentiles(0.5, 0.95, 0.99),
        "qoe": {**latency.qoe.percentiles(0.1, 0.5), "mean": latency.qoe.mean()},
        "tpot_seconds": latency.tpot.percentiles(0.5, 0.95, 0.99),
        "queue_wait_seconds": latency.queue_wait.percentiles(0.5, 0.95, 0.99),
        "event_loop_tasks": len(asyncio.all_tasks()),
    }


def kv_cache_section(core: CoreStats) -> dict[str, object] | None:
    """The embedded engine's KV cache (None: the core keeps none, as an upstream's)."""
    kv = core.kv_cache
    if kv is None:
        return None
    return {
        "usage_ratio": kv.usage_ratio,
        "used_blocks": kv.num_used_blocks,
        "total_blocks": kv.num_blocks,
        "free_slots": kv.num_free_slots,
        "total_slots": kv.num_slots,
        "bytes": core.kv_cache_bytes,
    }
