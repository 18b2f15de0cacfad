"""The ASGI application: routers, error handlers, and the life cycle of its stages."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from sluicegate import __version__
from sluicegate.api import (
    batches,
    embeddings,
    jobs,
    lifecycle,
    openai_routes,
    prefill,
    responses,
    resume,
    stats,
    web,
    websocket,
)
from sluicegate.api.errors import install_error_handlers
from sluicegate.api.metric_labels import declare_label_values
from sluicegate.api.openapi import install_openapi
from sluicegate.api.state import AppState
from sluicegate.config import Settings
from sluicegate.metrics.registry import Metrics


def create_app(settings: Settings) -> FastAPI:
    lifecycle.check_store_reachable(settings)
    state = AppState(settings, Metrics(settings.engine))
    declare_label_values(state.metrics, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await lifecycle.start(state)
        try:
            yield
        finally:
            await lifecycle.stop(state)

    app = FastAPI(
        title="Sluicegate",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.sluicegate = state
    install_error_handlers(app)
    for module in (
        openai_routes,
        responses,
        embeddings,
        prefill,
        jobs,
        batches,
        resume,
        websocket,
        stats,
        web,
    ):
        app.include_router(module.router)
    install_openapi(app)
    return app
