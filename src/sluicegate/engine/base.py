"""The engine protocol: computes the steps the scheduler plans.

The engine owns its KV cache storage; the scheduler owns the *accounting* (which slot a
sequence lives in and how many of its tokens are cached).  The step's boundary types
(:class:`~sluicegate.scheduler.step.StepPlan`, ``StepResult``) live in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluicegate.scheduler.step import StepPlan, StepResult


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

    def step(self, plan: StepPlan) -> StepResult: ...

    def warmed_up(self) -> None:
        """The start-up calibration is over (:func:`~sluicegate.engine.calibrate.warm_up`):
        background work that would skew its timings may begin (the torch engine's build or
        load of its compiled decode step).  Called once, before the first request's step."""
        ...

    def close(self) -> None: ...
