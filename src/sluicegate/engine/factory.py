"""Build the configured engine and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sluicegate.config import Settings
from sluicegate.engine.base import Engine
from sluicegate.engine.sampling_defaults import SamplingDefaults, with_settings
from sluicegate.engine.sim import SimEngine
from sluicegate.engine.tokenizer import TextTokenizer, byte_level_tokenizer
from sluicegate.engine.upstream.pool import UpstreamPool


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


def build_engine(settings: Settings) -> LoadedEngine:
    if settings.engine == "upstream":
        pool = UpstreamPool(settings)
        max_model_len = (
            settings.max_model_len
            if "max_model_len" in settings.model_fields_set
            else UPSTREAM_MAX_MODEL_LEN
        )
        return LoadedEngine(
            pool, upstream_tokenizer(settings), settings.served_model_name or "",
            max_model_len, sum(u.max_concurrent for u in settings.upstream_configs),
            sampling_defaults(settings, SamplingDefaults()),
        )  # fmt: skip
    if settings.engine == "sim":
        sim = SimEngine(settings.sim_step_base_ms, settings.sim_step_per_token_ms)
        name = settings.served_model_name or sim.model_name
        return LoadedEngine(
            sim, sim.tokenizer, name, settings.max_model_len, settings.max_num_seqs,
            sampling_defaults(settings, SamplingDefaults()),
        )  # fmt: skip
    try:  # imported here so that a sim server never loads torch
        from sluicegate.engine.torch.runner import TorchEngine
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise EngineLoadError(f"the torch engine is not available: {exc}") from exc
    engine = TorchEngine(
        model_path=settings.model,
        dtype=settings.dtype,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        cache_dir=settings.cache_dir,
        num_threads=settings.torch_threads,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        compile=settings.engine_compile,
    )
    name = settings.served_model_name or engine.model_name
    return LoadedEngine(
        engine, engine.tokenizer, name, engine.max_model_len, engine.max_num_seqs,
        sampling_defaults(settings, engine.sampling_defaults),
        engine.calibration_path() if settings.reuse_calibration else None,
    )  # fmt: skip


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
