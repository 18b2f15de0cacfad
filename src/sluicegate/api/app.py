"""The ASGI application: routes, error handlers, and the engine's life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from sluicegate import __version__
from sluicegate.api.errors import APIError, install_error_handlers
from sluicegate.api.openai_routes import json_response, router
from sluicegate.api.runtime import PRIORITY_NAMES, Runtime, get_runtime
from sluicegate.config import Settings
from sluicegate.engine.core import EngineCore, StepStats
from sluicegate.engine.factory import build_engine
from sluicegate.metrics.registry import Metrics
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger("sluicegate")


async def load_engine(runtime: Runtime) -> None:
    """Load the engine off the event loop so /health answers while a model loads."""
    settings = runtime.settings
    try:
        loaded = await asyncio.to_thread(build_engine, settings)
    except Exception as exc:
        runtime.load_error = str(exc)
        logger.exception("engine failed to load")
        return
    max_model_len = min(settings.max_model_len, loaded.max_model_len)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len,
            kv_block_size=settings.kv_block_size,
            num_kv_blocks=settings.num_kv_blocks,
        ),
        eos_token_ids=loaded.tokenizer.eos_token_ids,
    )
    metrics = runtime.metrics

    def on_step(step: StepStats) -> None:
        metrics.engine_step_seconds.observe(step.step_seconds)
        metrics.batch_size.observe(step.num_seqs)
        metrics.batch_tokens.observe(step.num_batched_tokens)

    core = EngineCore(
        loaded.engine,
        loaded.tokenizer,
        scheduler,
        asyncio.get_running_loop(),
        on_step=on_step,
        on_abort=metrics.cancel_latency_seconds.observe,
    )
    core.start()
    runtime.core = core
    runtime.tokenizer = loaded.tokenizer
    runtime.model_name = loaded.model_name
    runtime.max_model_len = max_model_len
    runtime.ready = True
    metrics.engine_up.labels(metrics.engine).set(1)
    logger.info(
        "engine %s ready: model %s, max_model_len %d",
        settings.engine, loaded.model_name, max_model_len,
    )  # fmt: skip


def refresh_state_metrics(runtime: Runtime) -> None:
    """Copy the engine's latest state into gauges and counters (at scrape time)."""
    if runtime.core is None:
        return
    metrics = runtime.metrics
    stats = runtime.core.stats()
    sched = stats.scheduler
    metrics.requests_running.set(sched.num_running)
    for priority, name in PRIORITY_NAMES.items():
        metrics.requests_waiting.labels(name).set(sched.num_waiting_by_priority.get(priority, 0))
    metrics.kv_cache_usage_ratio.set(sched.kv_cache.usage_ratio)
    metrics.engine_up.labels(metrics.engine).set(1 if stats.engine_up and runtime.ready else 0)
    for reason, count in sched.preemptions_by_reason.items():
        seen = runtime.preemptions_seen.get(reason, 0)
        if count > seen:
            metrics.preemptions_total.labels(reason).inc(count - seen)
            runtime.preemptions_seen[reason] = count


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings=settings, metrics=Metrics(settings.engine))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(load_engine(runtime))
        runtime.tasks.add(task)
        task.add_done_callback(runtime.tasks.discard)
        runtime.flow.start()
        try:
            yield
        finally:
            runtime.ready = False
            task.cancel()
            await runtime.flow.stop()
            if runtime.core is not None:
                await asyncio.to_thread(runtime.core.shutdown)

    app = FastAPI(
        title="Sluicegate",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.runtime = runtime
    install_error_handlers(app)
    app.include_router(router)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: HTTPRequest) -> Response:
        rt = get_runtime(request)
        if rt.ready:
            return json_response({"status": "ready", "model": rt.model_name})
        if rt.load_error is not None:
            raise APIError(503, f"The engine failed to load: {rt.load_error}", code="load_failed")
        raise APIError(
            503, "The engine is loading.", code="not_ready", headers={"retry-after": "2"}
        )

    @app.get("/metrics")
    async def metrics_endpoint(request: HTTPRequest) -> Response:
        rt = get_runtime(request)
        refresh_state_metrics(rt)
        return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats(request: HTTPRequest) -> Response:
        rt = get_runtime(request)
        if rt.core is None:
            return json_response({"ready": False})
        core = rt.core.stats()
        kv = core.scheduler.kv_cache
        return json_response(
            {
                "ready": rt.ready,
                "model": rt.model_name,
                "requests_running": core.scheduler.num_running,
                "requests_waiting": core.scheduler.num_waiting,
                "kv_cache": {
                    "usage_ratio": kv.usage_ratio,
                    "used_blocks": kv.num_used_blocks,
                    "total_blocks": kv.num_blocks,
                    "free_slots": kv.num_free_slots,
                    "total_slots": kv.num_slots,
                },
                "requests_paused": core.scheduler.num_paused,
                "streams_paused": rt.flow.num_paused,
                "streams": rt.flow.snapshot(),
                "preemptions_total": core.scheduler.num_preemptions_total,
                "preemptions_by_reason": core.scheduler.preemptions_by_reason,
                "engine_steps_total": core.num_steps,
            }
        )

    return app
