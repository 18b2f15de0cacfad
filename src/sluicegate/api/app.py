"""The ASGI application: routes, error handlers, and the engine's life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate import __version__
from sluicegate.api.errors import APIError, install_error_handlers
from sluicegate.api.openai_routes import json_response, router
from sluicegate.api.runtime import Runtime, get_runtime
from sluicegate.config import Settings
from sluicegate.engine.core import EngineCore
from sluicegate.engine.factory import build_engine
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
    core = EngineCore(loaded.engine, loaded.tokenizer, scheduler, asyncio.get_running_loop())
    core.start()
    runtime.core = core
    runtime.tokenizer = loaded.tokenizer
    runtime.model_name = loaded.model_name
    runtime.max_model_len = max_model_len
    runtime.ready = True
    logger.info(
        "engine %s ready: model %s, max_model_len %d",
        settings.engine, loaded.model_name, max_model_len,
    )  # fmt: skip


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(load_engine(runtime))
        runtime.tasks.add(task)
        task.add_done_callback(runtime.tasks.discard)
        try:
            yield
        finally:
            runtime.ready = False
            task.cancel()
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
                "preemptions_total": core.scheduler.num_preemptions_total,
                "engine_steps_total": core.num_steps,
            }
        )

    return app
