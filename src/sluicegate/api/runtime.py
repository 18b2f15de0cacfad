"""What the HTTP handlers share: settings, the engine core, flow control, metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request as HTTPRequest

from sluicegate.api.front_door import FrontDoor

if TYPE_CHECKING:
    from sluicegate.api.generation import Generation
    from sluicegate.api.jobs import JobRunner
    from sluicegate.api.session_registry import SessionRegistry
from sluicegate.config import Settings
from sluicegate.engine.core import EngineCore
from sluicegate.engine.output import FlushPolicy
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.metrics.registry import Metrics
from sluicegate.metrics.window import SlidingWindow
from sluicegate.store.base import Store
from sluicegate.stream.flow import FlowConfig, FlowController

PRIORITY_NAMES = {0: "interactive", 1: "batch"}


class EngineFlowActions:
    """Flow-control decisions, carried to the engine thread and counted."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def pause(self, request_id: str) -> None:
        if self._runtime.core is not None:
            self._runtime.core.pause_request(request_id)
        if self._runtime.front_door is not None:
            # A paused sequence computes nothing: queued work may be dispatched in its
            # place (the scheduler gives it the paused sequence's slot when it needs one).
            self._runtime.front_door.set_parked(request_id, True)
        self._runtime.metrics.streams_paused.inc()

    def resume(self, request_id: str, paused_seconds: float) -> None:
        if self._runtime.core is not None:
            self._runtime.core.resume_request(request_id)
        if self._runtime.front_door is not None:
            self._runtime.front_door.set_parked(request_id, False)
        self._runtime.metrics.streams_paused.dec()
        self._runtime.metrics.stream_pause_seconds.observe(paused_seconds)

    def preempt(self, request_id: str) -> None:
        if self._runtime.core is not None:
            self._runtime.core.preempt_request(request_id)
        if self._runtime.front_door is not None:
            # Its KV is freed: the engine has room for another request meanwhile.
            self._runtime.front_door.set_parked(request_id, True)

    def evicted(self, request_id: str) -> None:
        if self._runtime.core is not None:
            self._runtime.core.abort_request(request_id)
        self._runtime.metrics.streams_evicted_total.inc()


@dataclass
class Runtime:
    settings: Settings
    metrics: Metrics
    core: EngineCore | None = None
    front_door: FrontDoor | None = None
    jobs: JobRunner | None = None
    #: Live requests by id (for cancellation); entries leave when the request ends.
    generations: dict[str, Generation] = field(default_factory=dict)
    #: Recent per-request latencies for /v1/stats.
    ttft_window: SlidingWindow = field(default_factory=SlidingWindow)
    tpot_window: SlidingWindow = field(default_factory=SlidingWindow)
    queue_wait_window: SlidingWindow = field(default_factory=SlidingWindow)
    tokenizer: TextTokenizer | None = None
    model_name: str = ""
    max_model_len: int = 0
    ready: bool = False
    draining: bool = False
    #: Sequences in the latest engine step (written by the engine thread).
    last_batch_size: int = 0
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    preemptions_seen: dict[str, int] = field(default_factory=dict)
    flow: FlowController = field(init=False)
    flush_policy: FlushPolicy = field(init=False)
    #: Replay logs, leases and shared buckets (connected at startup, before the engine).
    store: Store | None = None
    #: The resumable streams produced by this replica (set by ``create_app``).
    sessions: SessionRegistry = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.flow = FlowController(
            FlowConfig(
                enabled=s.pause,
                high_water_tokens=s.high_water_tokens,
                low_water_tokens=s.low_water_tokens,
                high_water_bytes=s.high_water_bytes,
                pause_preempt_seconds=s.pause_preempt_seconds,
                stall_timeout_seconds=s.stall_timeout_seconds,
            ),
            EngineFlowActions(self),
        )
        self.flush_policy = FlushPolicy(
            interval_seconds=s.flush_interval_ms / 1000.0,
            max_tokens=s.flush_max_tokens,
            heartbeat_seconds=s.heartbeat_seconds,
        )


def get_runtime(request: HTTPRequest) -> Runtime:
    runtime = request.app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime
