"""The application's state: loading, ready (every stage present), or draining.

Handlers reach the stages through :func:`ready_state`, the one place that answers
"not ready" while the engine loads (or failed to load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import HTTPConnection

from sluicegate.admission.tenants import AdminKey
from sluicegate.api.body import BodyWorkers
from sluicegate.config import Settings
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.queue.batches import Batches
from sluicegate.queue.jobs import JobRunner
from sluicegate.queue.journal_location import JournalLocation
from sluicegate.service.generation import Generation
from sluicegate.service.service import Service
from sluicegate.store.base import Store
from sluicegate.store.errors import StoreUnavailable
from sluicegate.stream.flow import FlowController
from sluicegate.stream.sessions import SessionRegistry


@dataclass(slots=True)
class Ready:
    """Every stage a request needs; it exists once the engine has loaded."""

    service: Service
    store: Store
    flow: FlowController
    sessions: SessionRegistry
    jobs: JobRunner
    #: The job journal's file (and its lock, or its temporary directory).
    journal_location: JournalLocation
    #: The Batch API's files and batches, beside the journal.
    batches: Batches | None = None


@dataclass(slots=True)
class AppState:
    """One application's life.  Owned by the event loop."""

    settings: Settings
    metrics: Metrics
    started_at: float = field(default_factory=time.time)
    #: Connected at start-up, before the engine loads.
    store: Store | None = None
    #: Set once the engine has loaded and every stage has started.
    ready: Ready | None = None
    load_error: str | None = None
    draining: bool = False
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Preemptions already counted into the Prometheus counter, by reason.
    preemptions_seen: dict[str, int] = field(default_factory=dict)
    #: The scheduler's cumulative counters as last exported (prefix cache, speculation).
    counters_seen: dict[str, float] = field(default_factory=dict)
    #: Running ``/v1/prefill`` warm-ups by (tenant, user), and the tasks that run them.
    warmups: dict[tuple[str, str], Generation] = field(default_factory=dict)
    warmup_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    #: Warm-ups by outcome since start: accepted, superseded (by a newer one or the
    #: user's request), completed (also ``sluicegate_prefill_requests_total``).
    warmup_counts: dict[str, int] = field(default_factory=dict)
    #: Parse and tokenise large request bodies off the event loop.
    body_workers: BodyWorkers = field(default_factory=BodyWorkers)
    #: Called with a one-line reason when the server cannot go on (the engine failed to
    #: load): the server exits non-zero rather than answer 503 for ever.
    on_fatal: Callable[[str], None] | None = None
    #: A server process's own app (not one of several in a test process): once the engine
    #: has loaded, what lives as long as the process leaves the collector's generations.
    owns_process: bool = False
    #: Guards ``/v1/stats`` and ``/metrics`` when ``admin_api_key`` is set.
    admin_key: AdminKey = field(init=False)

    def __post_init__(self) -> None:
        key = self.settings.admin_api_key
        self.admin_key = AdminKey(key.get_secret_value() if key is not None else None)

    def require_ready(self) -> Ready:
        """The stages, or the 503 that says why there are none yet.  (While draining they
        are still here: admission refuses new work, and streams may still be resumed.)"""
        if self.ready is not None:
            return self.ready
        raise not_ready(self)


def store_down(state: AppState) -> bool:
    """The shared store is down and the failure mode refuses work without it."""
    store = state.store
    if store is None:
        return False
    try:
        store.require_available()
    except StoreUnavailable:
        return True
    return False


def not_ready(state: AppState) -> APIError:
    """Why the server cannot take a request now: loading, failed to load, or draining."""
    if state.draining:
        return APIError(
            503,
            "The server is shutting down; retry on another replica.",
            code="draining",
            headers={"retry-after": "1"},
        )
    if state.load_error is not None:
        return APIError(503, f"The server cannot serve: {state.load_error}", code="load_failed")
    if state.ready is not None and store_down(state):
        return APIError(
            503,
            "The shared store is unreachable and store_failure_mode is fail_closed.",
            code="store_unavailable",
            headers={"retry-after": "1"},
        )
    return APIError(
        503,
        "The model is still loading; retry shortly.",
        code="not_ready",
        headers={"retry-after": "2"},
    )


def app_state(connection: HTTPConnection) -> AppState:
    state = connection.app.state.sluicegate
    assert isinstance(state, AppState)
    return state


def ready_state(connection: HTTPConnection) -> Ready:
    """The stages for a handler (HTTP or WebSocket), or the 503 that says why not."""
    return app_state(connection).require_ready()
