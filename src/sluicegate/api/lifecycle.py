"""Start-up, shutdown and graceful drain.

Start-up connects the store first (shared buckets and every stream need it), then loads
the engine in the background, so ``/health`` answers while a model loads; when it has
loaded, the service, flow control, the stream sessions and the job runner start, and
the app is ready.  Shutdown stops them in the reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Coroutine
from typing import Any

from sluicegate.api.batches import batch_aware_executor
from sluicegate.api.responses_background import background_aware, restore_background
from sluicegate.api.state import AppState, Ready
from sluicegate.config import Settings
from sluicegate.engine.output import FlushPolicy
from sluicegate.queue.batches import Batches
from sluicegate.queue.jobs import JobLimits, JobListener, JobRunner, open_journal
from sluicegate.queue.journal import JobRecord
from sluicegate.queue.journal_location import claim_journal
from sluicegate.service.service import Service
from sluicegate.store import Store, StoreConfig, StoreFailureMode, StoreUnavailable, open_store
from sluicegate.store.records import DegradedOutcome
from sluicegate.stream.flow import FlowConfig, FlowController
from sluicegate.stream.sessions import SessionRegistry

logger = logging.getLogger("sluicegate")


#: How often a shared store is pinged, so that readiness and fail_closed admission
#: follow an outage even when no request touches the store.
STORE_CHECK_INTERVAL_SECONDS = 1.0


async def start(state: AppState) -> None:
    """Connect the store, then load the engine in the background."""
    store = await connect_store(state)
    _background(state, _load(state, store), "sluicegate-load")
    if store.url != "memory":
        _background(state, _watch_store(state, store), "sluicegate-store-check")
    state.store = store


def _background(state: AppState, work: Coroutine[Any, Any, None], name: str) -> None:
    task = asyncio.create_task(work, name=name)
    state.tasks.add(task)
    task.add_done_callback(state.tasks.discard)


async def _watch_store(state: AppState, store: Store) -> None:
    while True:
        state.metrics.store_available.set(1 if await store.ping() else 0)
        await asyncio.sleep(STORE_CHECK_INTERVAL_SECONDS)


async def stop(state: AppState) -> None:
    """Stop every stage, last started first."""
    for task in list(state.tasks):
        task.cancel()
    ready, state.ready = state.ready, None
    if ready is not None:
        # The job runner first: a background response's job would take its stream over
        # again once the sessions had stopped.
        await ready.jobs.stop()
        ready.journal_location.release()
        await ready.sessions.stop()
        await ready.flow.stop()
        await ready.service.close()
    if state.store is not None:
        await state.store.close()
    state.body_workers.close()


async def _load(state: AppState, store: Store) -> None:
    settings = state.settings
    try:
        service = await Service.load(
            settings,
            state.metrics,
            bucket_factory=store.bucket,
            require_store=store.require_available,
        )
    except Exception as exc:
        # One line, and the process exits: a server that can never be ready must not
        # stay up answering 503 (clients and load balancers would retry it for ever).
        what = settings.engine if settings.model is None else f"{settings.engine}, {settings.model}"
        state.load_error = f"the engine failed to load ({what}): {exc}"
        logger.debug("engine load failure", exc_info=True)
        if state.on_fatal is not None:
            state.on_fatal(state.load_error)
        else:
            logger.error("%s", state.load_error)
        return
    if state.owns_process:
        # What lives as long as the process (the model, the tokenizer, the app) leaves the
        # collector's generations: a collection then scans only what requests made, and
        # does not pause the event loop for the whole heap.
        gc.freeze()
    state.metrics.kv_cache_bytes.set(service.core.stats().kv_cache_bytes)
    pauses = state.metrics.stream_pauses_total
    flow = FlowController(flow_config(settings), service, lambda stage: pauses.labels(stage).inc())
    flow.start()
    sessions = SessionRegistry(
        service,
        store,
        flow,
        flush_policy(settings),
        detached_grace_seconds=settings.detached_grace_seconds,
        lease_ttl_seconds=settings.lease_ttl_seconds,
    )
    sessions.start()
    location = claim_journal(settings.journal_path, settings.cache_dir)
    limits = JobLimits(
        max_job_bytes=settings.max_job_bytes,
        max_unfinished_jobs_per_tenant=settings.max_unfinished_jobs_per_tenant,
        retention_seconds=settings.job_retention_seconds,
    )
    journal = open_journal(location.path)
    executor = background_aware(batch_aware_executor(service), sessions)
    jobs = JobRunner(journal, settings.max_background_jobs_in_memory, executor, limits)
    files_dir = location.path.with_name(location.path.stem + "-files")
    batches = await asyncio.to_thread(Batches, journal, files_dir)
    jobs.listener = batch_listener(batches)
    await restore_background(sessions, journal)
    await jobs.start()
    state.ready = Ready(service, store, flow, sessions, jobs, location, batches)


def batch_listener(batches: Batches) -> JobListener:
    """A batch is finalized when its last line is recorded; once a second, batches past
    their window expire (and any left unfinalized by a crash is finalized)."""

    async def listen(record: JobRecord | None) -> None:
        if record is None:
            await asyncio.to_thread(batches.sweep)
        elif record.batch_id is not None:
            await asyncio.to_thread(batches.finish_if_done, record.batch_id)

    return listen


def flow_config(settings: Settings) -> FlowConfig:
    return FlowConfig(
        enabled=settings.pause,
        high_water_tokens=settings.high_water_tokens,
        low_water_tokens=settings.low_water_tokens,
        high_water_bytes=settings.high_water_bytes,
        stall_timeout_seconds=settings.stall_timeout_seconds,
    )


def flush_policy(settings: Settings) -> FlushPolicy:
    return FlushPolicy(
        interval_seconds=settings.flush_interval_ms / 1000.0,
        max_tokens=settings.flush_max_tokens,
        heartbeat_seconds=settings.heartbeat_seconds,
    )


async def drain(state: AppState) -> None:
    """Graceful shutdown: refuse new work, let running streams finish, then cut the rest.

    New requests get 503 ``draining`` with ``Retry-After``; ``/ready`` turns false so a
    load balancer stops sending.  Streams still running after ``drain_grace_seconds``
    are checkpointed (their logs hold every delivered token; their leases are released,
    so another replica can continue them at once) and get a final event telling them to
    resume with their stream id.
    """
    state.draining = True
    ready = state.ready
    if ready is None:
        return
    service = ready.service
    service.admission.start_draining()
    grace = state.settings.drain_grace_seconds
    deadline = time.monotonic() + grace
    logger.info("draining: %d requests running, grace %.1fs", len(service.generations), grace)
    while service.generations and time.monotonic() < deadline:  # noqa: ASYNC110 - polls a dict
        await asyncio.sleep(0.05)
    remaining = list(service.generations.values())
    for generation in remaining:
        session = ready.sessions.get(generation.request_id)
        if session is not None:
            session.stop("draining", "drained")
        else:
            service.stop(generation, "drained")
    # Every producer logs what it has and checkpoints before the process goes.
    await ready.sessions.wait_all(within_seconds=5.0)
    if remaining:
        logger.info("drain deadline: %d streams checkpointed to resume elsewhere", len(remaining))
        await asyncio.sleep(0.2)  # let their writers send the final event


def store_config(settings: Settings) -> StoreConfig:
    return StoreConfig(
        replay_max_events=settings.replay_max_events,
        replay_ttl_seconds=settings.replay_ttl_seconds,
        store_failure_mode=StoreFailureMode(settings.store_failure_mode),
    )


async def connect_store(state: AppState) -> Store:
    """Open the store named by ``--store``; raises StoreUnavailable if it cannot be reached."""
    settings = state.settings
    metrics = state.metrics
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
    with contextlib.suppress(RuntimeError):
        asyncio.get_running_loop()
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
        raise SystemExit(f"sluicegate: {error}") from None
