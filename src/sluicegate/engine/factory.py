"""Build the configured engine and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.config import Settings
from sluicegate.engine.base import Engine
from sluicegate.engine.sim import SimEngine
from sluicegate.engine.tokenizer import TextTokenizer


class EngineLoadError(RuntimeError):
    """The engine could not be built; the message says why and what to do."""


@dataclass(slots=True)
class LoadedEngine:
    engine: Engine
    tokenizer: TextTokenizer
    model_name: str
    max_model_len: int


def build_engine(settings: Settings) -> LoadedEngine:
    if settings.engine == "sim":
        sim = SimEngine(settings.sim_step_base_ms, settings.sim_step_per_token_ms)
        name = settings.served_model_name or sim.model_name
        return LoadedEngine(sim, sim.tokenizer, name, settings.max_model_len)
    if settings.engine == "torch":
        raise EngineLoadError(
            "the embedded torch engine is not in this build yet; use --engine sim"
        )
    raise EngineLoadError(
        "engine 'upstream' is not available in this version; use --engine torch or sim"
    )
