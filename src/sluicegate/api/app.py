"""The ASGI application: routes, error handlers, and the engine's life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from sluicegate import __version__
from sluicegate.api.errors import install_error_handlers
from sluicegate.api.front_door import FrontDoor
from sluicegate.api.generation import drain_generation
from sluicegate.api.jobs import JobRunner, open_journal
from sluicegate.api.jobs import router as jobs_router
from sluicegate.api.openai_routes import json_response, router
from sluicegate.api.resume import router as resume_router
from sluicegate.api.runtime import PRIORITY_NAMES, Runtime, get_runtime
from sluicegate.api.session_registry import SessionRegistry
from sluicegate.api.web import router as web_router
from sluicegate.api.websocket import router as ws_router
from sluicegate.config import Settings
from sluicegate.engine.core import EngineCore, StepStats
from sluicegate.engine.factory import build_engine
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.store import Store, StoreConfig, StoreFailureMode, StoreUnavailable, open_store
from sluicegate.store.base import DegradedOutcome

logger = logging.getLogger("sluicegate")


async def load_engine(runtime: Runtime, port: int) -> None:
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

    loop = asyncio.get_running_loop()
    front_door_ref: list[FrontDoor] = []

    def on_step(step: StepStats) -> None:  # the engine thread
        runtime.last_batch_size = step.num_seqs
        metrics.engine_step_seconds.observe(step.step_seconds)
        metrics.batch_size.observe(step.num_seqs)
        metrics.batch_tokens.observe(step.num_batched_tokens)
        if front_door_ref:
            loop.call_soon_threadsafe(front_door_ref[0].record_step, step.step_seconds)

    core = EngineCore(
        loaded.engine,
        loaded.tokenizer,
        scheduler,
        asyncio.get_running_loop(),
        on_step=on_step,
        on_abort=metrics.cancel_latency_seconds.observe,
    )
    core.start()
    store = runtime.store
    front_door = FrontDoor(
        settings, metrics, core.add_request, max_model_len,
        bucket_factory=store.bucket if store is not None else None,
    )  # fmt: skip
    front_door.start()
    front_door_ref.append(front_door)
    runtime.front_door = front_door
    runtime.core = core
    runtime.tokenizer = loaded.tokenizer
    runtime.model_name = loaded.model_name
    runtime.max_model_len = max_model_len
    runtime.ready = True
    jobs = JobRunner(runtime, open_journal(runtime, port), settings.max_background_jobs_in_memory)
    await jobs.start()
    runtime.jobs = jobs
    metrics.engine_up.labels(metrics.engine).set(1)
    logger.info(
        "engine %s ready: model %s, max_model_len %d",
        settings.engine, loaded.model_name, max_model_len,
    )  # fmt: skip


def store_config(settings: Settings) -> StoreConfig:
    return StoreConfig(
        replay_max_events=settings.replay_max_events,
        replay_ttl_seconds=settings.replay_ttl_seconds,
        store_failure_mode=StoreFailureMode(settings.store_failure_mode),
    )


async def connect_store(runtime: Runtime) -> Store:
    """Open the store named by ``--store``; raises StoreUnavailable if it cannot be reached."""
    settings = runtime.settings
    metrics = runtime.metrics
    store = open_store(settings.store, store_config(settings))

    def degraded(operation: str, outcome: DegradedOutcome) -> None:
        metrics.store_degraded_operations_total.labels(operation, outcome.value).inc()
        metrics.store_available.set(0)

    store.on_degraded = degraded
    await store.connect()
    logger.info("store %s connected (failure mode %s)", store.url, settings.store_failure_mode)
    return store


def check_store_reachable(settings: Settings) -> None:
    """At startup, before serving: exit with a clear message if Redis cannot be reached.

    (An error raised later, in the ASGI lifespan, would only stop uvicorn, which exits 0.)
    """
    if settings.store == "memory":
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return  # built inside a running loop (tests): the lifespan checks instead

    async def probe() -> None:
        store = open_store(settings.store, store_config(settings))
        try:
            await store.connect()
        finally:
            await store.close()

    try:
        asyncio.run(probe())
    except StoreUnavailable as error:
        logger.error("%s", error)
        raise SystemExit(f"sluicegate: {error}") from None


def refresh_state_metrics(runtime: Runtime) -> None:
    """Copy the engine's latest state into gauges and counters (at scrape time)."""
    if runtime.store is not None:
        runtime.metrics.store_available.set(1 if runtime.store.available else 0)
    if runtime.core is None:
        return
    metrics = runtime.metrics
    stats = runtime.core.stats()
    sched = stats.scheduler
    metrics.requests_running.set(sched.num_running)
    queued = runtime.front_door.queued_by_class() if runtime.front_door is not None else {}
    for priority, name in PRIORITY_NAMES.items():
        metrics.requests_waiting.labels(name).set(
            sched.num_waiting_by_priority.get(priority, 0) + queued.get(name, 0)
        )
    metrics.kv_cache_usage_ratio.set(sched.kv_cache.usage_ratio)
    metrics.engine_up.labels(metrics.engine).set(1 if stats.engine_up and runtime.ready else 0)
    for reason, count in sched.preemptions_by_reason.items():
        seen = runtime.preemptions_seen.get(reason, 0)
        if count > seen:
            metrics.preemptions_total.labels(reason).inc(count - seen)
            runtime.preemptions_seen[reason] = count


def _front_door_stats(runtime: Runtime) -> dict[str, object]:
    front_door = runtime.front_door
    if front_door is None:
        return {}
    breaker = front_door.breaker
    return {
        "queue": {
            "queued": front_door.num_queued,
            "queued_by_class": front_door.queued_by_class(),
            "service_rate_requests_per_second": front_door.estimator.requests_per_second(),
            "service_rate_tokens_per_second": front_door.estimator.tokens_per_second(),
        },
        "breaker_state": breaker.state.label if breaker is not None else "disabled",
        "rejections_by_reason": {
            sample.labels["reason"]: sample.value
            for metric in runtime.metrics.rejections_total.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        },
    }


async def drain(runtime: Runtime) -> None:
    """Graceful shutdown: refuse new work, let running streams finish, then cut the rest.

    New requests get 503 ``draining`` with ``Retry-After``; ``/ready`` turns false so a
    load balancer stops sending.  Streams still running after ``drain_grace_seconds``
    are checkpointed (their logs hold every delivered token; their leases are released,
    so another replica can continue them at once) and get a final event telling them to
    resume with their stream id.
    """
    runtime.draining = True
    if runtime.front_door is not None:
        runtime.front_door.controller.start_draining()
    deadline = time.monotonic() + runtime.settings.drain_grace_seconds
    logger.info(
        "draining: %d requests running, grace %.1fs",
        len(runtime.generations), runtime.settings.drain_grace_seconds,
    )  # fmt: skip
    while runtime.generations and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a dict
        await asyncio.sleep(0.05)
    remaining = list(runtime.generations.values())
    for generation in remaining:
        if generation.session is not None:
            generation.session.stop("draining", "drained")
        else:
            drain_generation(runtime, generation)
    # Every producer logs what it has and checkpoints before the process goes.
    await runtime.sessions.wait_all(within_seconds=5.0)
    if remaining:
        logger.info("drain deadline: %d streams checkpointed to resume elsewhere", len(remaining))
        await asyncio.sleep(0.2)  # let their writers send the final event


def create_app(settings: Settings) -> FastAPI:
    check_store_reachable(settings)
    runtime = Runtime(settings=settings, metrics=Metrics(settings.engine))
    runtime.sessions = SessionRegistry(runtime)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The store first: the front door's shared buckets and every stream need it.
        runtime.store = await connect_store(runtime)
        runtime.sessions.start()
        task = asyncio.create_task(load_engine(runtime, settings.port))
        runtime.tasks.add(task)
        task.add_done_callback(runtime.tasks.discard)
        runtime.flow.start()
        try:
            yield
        finally:
            runtime.ready = False
            task.cancel()
            await runtime.sessions.stop()
            await runtime.flow.stop()
            if runtime.jobs is not None:
                await runtime.jobs.stop()
            if runtime.front_door is not None:
                await runtime.front_door.stop()
            if runtime.core is not None:
                await asyncio.to_thread(runtime.core.shutdown)
            await runtime.store.close()

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
    app.include_router(jobs_router)
    app.include_router(resume_router)
    app.include_router(ws_router)
    app.include_router(web_router)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: HTTPRequest) -> Response:
        rt = get_runtime(request)
        if rt.draining:
            raise APIError(
                503, "The server is shutting down.", code="draining", headers={"retry-after": "1"}
            )
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
                "requests_waiting": core.scheduler.num_waiting
                + (rt.front_door.num_queued if rt.front_door is not None else 0),
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
                **_front_door_stats(rt),
                "engine_steps_total": core.num_steps,
                "batch_size": rt.last_batch_size if core.scheduler.num_running else 0,
                "live_requests": len(rt.generations),
                "latency_window_seconds": rt.ttft_window.window_seconds,
                "ttft_seconds": rt.ttft_window.percentiles(0.5, 0.95, 0.99),
                "tpot_seconds": rt.tpot_window.percentiles(0.5, 0.95, 0.99),
                "queue_wait_seconds": rt.queue_wait_window.percentiles(0.5, 0.95, 0.99),
                "event_loop_tasks": len(asyncio.all_tasks()),
            }
        )

    return app
