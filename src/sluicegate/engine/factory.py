"""Build the configured engine, its tokenizer and its core: the one place that knows
which core it builds (:class:`~sluicegate.engine.base.EngineCore`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from sluicegate.config import Settings
from sluicegate.engine.base import CoreFeatures, CoreHooks, Engine, EngineCore
from sluicegate.engine.embedded import EmbeddedCore, WarmUp
from sluicegate.engine.sampling_defaults import SamplingDefaults, with_settings
from sluicegate.engine.sim import SimEngine
from sluicegate.engine.tokenizer import TextTokenizer, byte_level_tokenizer
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.pool_metrics import PoolCollector
from sluicegate.scheduler.pacing import PacingConfig, seat_objective_seconds
from sluicegate.scheduler.prefill import PrefillConfig
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig


class EngineLoadError(RuntimeError):
    """The engine could not be built; the message says why and what to do."""


#: The context an upstream engine is assumed to take when ``max_model_len`` is not set:
#: none of Sluicegate's own limit (the upstream refuses what is too long for it).
UPSTREAM_MAX_MODEL_LEN = 1 << 20


@dataclass(slots=True)
class LoadedEngine:
    #: The engine that computes steps, or the pool of upstreams that answer requests.
    engine: Engine | UpstreamPool
    tokenizer: TextTokenizer
    model_name: str
    max_model_len: int
    #: Sequences the engine can hold at once (its KV slots): the torch engine may have
    #: fewer than ``settings.max_num_seqs`` when its KV cache memory budget is smaller.
    max_num_seqs: int
    #: Sampling of a request that sets none: the model's recommended sampling under the
    #: ``default_*`` settings.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    #: Where the start-up calibration is saved and reused from (``reuse_calibration``;
    #: the torch engine only: the sim's is instant, an upstream calibrates otherwise).
    calibration_path: Path | None = None
    #: Whether an answer's computed positions may serve a later prompt as its prefix (not
    #: where answers compute differently from prompts: the torch engine's 4-bit weights).
    caches_answers: bool = True


def build_engine(settings: Settings) -> LoadedEngine:
    if settings.engine == "upstream":
        pool = UpstreamPool(settings)
        max_model_len = (
            settings.max_model_len
            if "max_model_len" in settings.model_fields_set
            else UPSTREAM_MAX_MODEL_LEN
        )
        return LoadedEngine(
            pool,
            upstream_tokenizer(settings),
            settings.served_model_name or "",
            max_model_len,
            sum(u.max_concurrent for u in settings.upstream_configs),
            sampling_defaults(settings, SamplingDefaults()),
        )
    if settings.engine == "sim":
        sim = SimEngine(settings.sim_step_base_ms, settings.sim_step_per_token_ms)
        name = settings.served_model_name or sim.model_name
        return LoadedEngine(
            sim,
            sim.tokenizer,
            name,
            settings.max_model_len,
            settings.max_num_seqs,
            sampling_defaults(settings, SamplingDefaults()),
        )
    try:  # imported here so that a sim server never loads torch
        from sluicegate.engine.torch.runner import TorchEngine
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise EngineLoadError(f"the torch engine is not available: {exc}") from exc
    engine = TorchEngine(
        model_path=settings.model,
        dtype=settings.dtype,
        max_num_seqs=settings.max_num_seqs,
        # Unset: the model's own context, up to the default (a 512-position model loads).
        max_model_len=settings.max_model_len
        if "max_model_len" in settings.model_fields_set
        else None,
        cache_dir=settings.cache_dir,
        num_threads=settings.torch_threads,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        compile=settings.engine_compile,
        weights=settings.weights,
    )
    name = settings.served_model_name or engine.model_name
    return LoadedEngine(
        engine,
        engine.tokenizer,
        name,
        engine.max_model_len,
        engine.max_num_seqs,
        sampling_defaults(settings, engine.sampling_defaults),
        engine.calibration_path() if settings.reuse_calibration else None,
        caches_answers=engine.caches_answers,
    )


def sampling_defaults(settings: Settings, model: SamplingDefaults) -> SamplingDefaults:
    """The model's recommended sampling under the operator's ``default_*`` settings."""
    return with_settings(
        model, settings.default_temperature, settings.default_top_p, settings.default_top_k
    )


def upstream_tokenizer(settings: Settings) -> TextTokenizer:
    """The tokenizer that counts an upstream's tokens for limits and admission."""
    spec = settings.upstream_tokenizer
    if spec == "bytes":
        return byte_level_tokenizer()
    try:  # imported here so that a sim server never loads torch
        from sluicegate.engine.torch.loader import default_model_path, load_tokenizer
    except ImportError:  # pragma: no cover - depends on the install
        if spec == "auto":
            return byte_level_tokenizer()
        raise EngineLoadError("upstream_tokenizer needs the torch extra to read models") from None
    if spec == "auto":
        try:
            return load_tokenizer(default_model_path(), settings.cache_dir)
        except Exception:
            return byte_level_tokenizer()
    try:
        return load_tokenizer(spec, settings.cache_dir)
    except Exception as exc:
        raise EngineLoadError(f"cannot load upstream_tokenizer {spec!r}: {exc}") from exc


def build_core(
    settings: Settings,
    loaded: LoadedEngine,
    loop: asyncio.AbstractEventLoop,
    hooks: CoreHooks | None = None,
    registry: CollectorRegistry | None = None,
) -> EngineCore:
    """The core that serves ``loaded``: the upstream core for a pool (its collector
    registered in ``registry``), else the embedded core with its scheduler."""
    if isinstance(loaded.engine, UpstreamPool):
        if registry is not None:
            registry.register(PoolCollector(loaded.engine))
        return UpstreamCore(
            loaded.engine, loaded.tokenizer, settings, hooks, max_model_len=loaded.max_model_len
        )
    features = CoreFeatures(constrains_output=settings.engine == "torch")
    return EmbeddedCore(
        loaded.engine,
        loaded.tokenizer,
        build_scheduler(settings, loaded),
        loop,
        hooks,
        model_name=loaded.model_name,
        # The sim's steps follow its own law (a sleep), so one timed pass is enough, made
        # before serving; a real engine's vary with the machine's load: the median of
        # three counts, and it serves on the cheap shapes while measuring the rest.
        warm=WarmUp(
            1 if settings.engine == "sim" else 3,
            loaded.calibration_path,
            background=settings.engine != "sim",
        ),
        features=features,
    )


def build_scheduler(settings: Settings, loaded: LoadedEngine) -> Scheduler:
    """The scheduler for ``loaded``: its context is the smaller of the configured and the
    model's, and every capacity figure (slots, KV blocks) derives from it once, here."""
    pacing = PacingConfig(
        enabled=settings.scheduling == "qoe",
        reading_tokens_per_second=settings.reading_tokens_per_second,
        lead_seconds=settings.qoe_lead_seconds,
    )
    tpot = settings.tpot_slo_ms / 1000.0 if settings.admission == "slo" else None
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=min(settings.max_num_seqs, loaded.max_num_seqs),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=min(settings.max_model_len, loaded.max_model_len),
            kv_block_size=settings.kv_block_size,
            num_kv_blocks=settings.num_kv_blocks,
            prefix_caching=settings.prefix_caching,
            cache_answers=loaded.caches_answers,
            speculation=SpeculationConfig(
                num_tokens=speculative_tokens(settings), max_batch=settings.speculative_max_batch
            ),
            pause_preempt_seconds=pause_preempt_seconds(settings),
            pacing=pacing,
            tpot_objective_seconds=seat_objective_seconds(tpot, pacing),
            prefill=prefill_config(settings),
        ),
        eos_token_ids=loaded.tokenizer.eos_token_ids,
    )


def prefill_config(settings: Settings) -> PrefillConfig:
    """Stall-free prefill and its lanes (docs/stall-free.md): the budget follows the TPOT
    objectives whatever the admission mode (a stream's pace is worth keeping either way)."""
    return PrefillConfig(
        stall_free=settings.stall_free_prefill,
        tpot_objective_seconds=settings.tpot_slo_ms / 1000.0,
        batch_tpot_objective_seconds=settings.batch_tpot_slo_ms / 1000.0,
        headroom=settings.prefill_headroom,
        overrun_quantile=settings.prefill_overrun_quantile,
        min_chunk_tokens=settings.min_prefill_chunk_tokens,
        long_prompt_tokens=settings.long_prompt_tokens,
        long_prompt_seconds=settings.long_prompt_seconds,
        max_pass_over_seconds=settings.long_prompt_max_pass_seconds,
    )


def speculative_tokens(settings: Settings) -> int:
    """Draft tokens a step may add: the setting on the embedded engine; on the sim engine
    only when set explicitly, because its text repeats, so drafts would be accepted far
    more often than on any model, and its timing (capacity planning, tests) would be too
    optimistic."""
    explicit = "speculative_tokens" in settings.model_fields_set
    return settings.speculative_tokens if settings.engine == "torch" or explicit else 0


def pause_preempt_seconds(settings: Settings) -> float | None:
    """When a paused sequence loses its KV: as configured; otherwise only when needed
    (admission by objective) or after 5 s (static admission, as before objectives)."""
    if not settings.pause:
        return None
    if settings.pause_preempt_seconds is not None:
        return settings.pause_preempt_seconds
    return None if settings.admission == "slo" else 5.0
