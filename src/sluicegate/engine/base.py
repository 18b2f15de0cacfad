"""The engine protocols: the :class:`Engine` computes the steps the scheduler plans; an
:class:`EngineCore` is what the service drives (the embedded core around an engine, or
the upstream core that relays requests to other servers).

The engine owns its KV cache storage; the scheduler owns the *accounting* (which slot a
sequence lives in and how many of its tokens are cached).  The step's boundary types
(:class:`~sluicegate.scheduler.step.StepPlan`, ``StepResult``) live in the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sluicegate.engine.output import RequestStream
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.kv_cache import KVCacheStats
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.scheduler.step import StepPlan, StepResult

#: :attr:`Engine.compile_status` while the compiled decode step's build or load runs
#: beside the engine (it computes on one thread meanwhile).
COMPILE_UNDER_WAY = ("building", "loading")


@dataclass(slots=True, frozen=True)
class EngineLimits:
    """What the engine can hold; the scheduler plans within these."""

    max_num_seqs: int
    max_model_len: int


class Engine(Protocol):
    """Computes planned steps.  Called from the engine thread only, never the event loop."""

    @property
    def model_name(self) -> str: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes allocated for the KV cache (0 for an engine that keeps none)."""
        ...

    @property
    def compile_status(self) -> str:
        """The torch engine's compiled decode step: ``off`` (always, for other engines),
        ``building``, ``loading``, ``ready`` or ``failed``."""
        ...

    @property
    def stats_sections(self) -> dict[str, object]:
        """The engine's own sections of ``/v1/stats`` (the torch engine's share of the
        CPUs; none for the sim)."""
        ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def warmed_up(self) -> None:
        """The start-up calibration is over (:func:`~sluicegate.engine.calibrate.warm_up`,
        or the rest of it, measured while idle): background work that would skew its
        timings may begin (the torch engine's build or load of its compiled decode step).
        Called once, from the engine thread or before it starts."""
        ...

    def close(self) -> None: ...


@dataclass(slots=True)
class StepStats:
    """Figures of one engine step, for metrics."""

    step_seconds: float
    num_seqs: int
    num_batched_tokens: int
    #: Sequences that decoded a token in it (0: a step of prompts alone).
    num_decoding: int = 0


@dataclass(slots=True)
class CoreHooks:
    """What a core reports as it goes (the embedded core calls them on its thread)."""

    #: After every engine step.
    on_step: Callable[[StepStats], None] | None = None
    #: An abort took effect, this many seconds after it was asked for.
    on_abort: Callable[[float], None] | None = None
    #: A paused sequence was resumed after this many seconds.
    on_resume: Callable[[float], None] | None = None


@dataclass(slots=True, frozen=True)
class CoreFeatures:
    """What a core does itself, so that the layers above never ask which core it is."""

    #: Requests are relayed to other servers, which are sent the client's own body (they
    #: validate and serve what the gateway does not act on; their models may change).
    relays: bool = False
    #: Structured output is enforced here, by grammar-constrained decoding (it needs
    #: logits: a real model, not the sim).
    constrains_output: bool = False


@dataclass(slots=True, frozen=True)
class CoreStats:
    """A core's state in one shape, whichever core it is: a snapshot, safe to read on the
    event loop."""

    num_running: int
    #: In the core's own waiting line (not the fair queue's).
    num_waiting: int
    num_paused: int
    #: Waiting for their pace (``max_tokens_per_second``), their seats lent out.
    num_throttled: int
    num_waiting_by_priority: dict[int, int]
    num_preemptions_total: int
    preemptions_by_reason: dict[str, int]
    #: Engine steps computed, or (a relaying core) upstream calls made.
    num_steps: int
    engine_up: bool
    #: Sequences in the latest engine step (0 for a relaying core).
    batch_size: int = 0
    #: None: this core keeps no KV cache (an upstream engine keeps its own).
    kv_cache: KVCacheStats | None = None
    kv_cache_bytes: int = 0
    #: The torch engine's compiled decode step (:attr:`Engine.compile_status`).
    compile_status: str = "off"
    #: The prefix cache's counters (None: prefix caching off or no cache here).
    prefix_cache: dict[str, float | int] | None = None
    #: Speculative decoding's counters (None: off).
    speculation: dict[str, float | int] | None = None
    #: Pace-aware scheduling's counters (None: fcfs).
    pacing: dict[str, float | int] | None = None
    #: The core's own sections of ``/v1/stats``: the seat limiter and cost model, or the
    #: upstreams.
    sections: dict[str, object] = field(default_factory=dict)


class EngineCore(Protocol):
    """What the service drives: the embedded core (the scheduler and an engine, torch or
    sim, on their own thread) or the upstream core (each request relayed from a pool of
    OpenAI-compatible servers).  Built by :func:`sluicegate.engine.factory.build_core`;
    nothing above the engine asks which one it holds.

    Every method is called on the event loop.
    """

    @property
    def features(self) -> CoreFeatures: ...

    @property
    def capacity(self) -> DispatchCapacity:
        """The seats and KV the dispatcher hands out (this core alone moves them)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    def model_max_len(self, model: str) -> int:
        """The context one served model takes (a relaying core's: what its upstreams
        say of it)."""
        ...

    @property
    def model_names(self) -> list[str]:
        """Every model served (a relaying core's change as its upstreams do)."""
        ...

    @property
    def embedding_models(self) -> list[str]:
        """Embedding models it relays ``POST /v1/embeddings`` to (an embedded core: none;
        the server's own embedding model is not a core's)."""
        ...

    async def relay_embeddings(self, model: str, body: bytes) -> tuple[int, bytes]:
        """An embeddings request for one of :attr:`embedding_models`: the status and the
        JSON body to answer with."""
        ...

    async def start(self, on_measured: Callable[[], None]) -> None:
        """Calibrate and start serving; ``on_measured`` is called once :meth:`estimate`
        reflects measurements (maybe later, in the background, for a relaying core whose
        upstreams are not reachable yet)."""
        ...

    async def close(self) -> None:
        """Fail what is running ("server shutting down") and release the engine."""
        ...

    def add_request(
        self, request: Request, stream: RequestStream, call: UpstreamCall | None = None
    ) -> None:
        """Run a dispatched request, writing its output to ``stream`` (a relaying core
        sends ``call`` upstream)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """End it before its next step; its stream gets a final ``abort`` output."""
        ...

    def pause_request(self, request_id: str) -> None:
        """A slow reader: stop producing for it and lend its seat (idempotent)."""
        ...

    def resume_request(self, request_id: str) -> None: ...

    def stats(self) -> CoreStats: ...

    def estimate(self) -> ServiceEstimate:
        """What admission predicts with: seats, step time, prompt and output lengths."""
        ...
