"""The settings of the embedded torch engine (part of :class:`~sluicegate.config.Settings`,
which inherits them; docs/engine.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from sluicegate.sizes import parse_memory_size


class TorchSettings(BaseModel):
    """How the embedded model computes: its dtype, weights, threads and memory."""

    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Torch engine dtype.")
    weights: Literal["auto", "full", "q4"] = Field(
        "full",
        description="Torch engine: the weights answers' tokens are computed with: q4 "
        "(4-bit, PyTorch's int4 CPU kernel with bfloat16 activations, in either dtype; a "
        "GGUF's own 4-bit blocks where it has them, else quantised at load), full (the "
        "dtype's) or auto (q4 for a 4-bit GGUF). Prompts always use the dtype's (docs/engine.md).",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="Torch intra-op threads (default: chosen for this machine)."
    )
    reuse_calibration: bool = Field(
        True,
        description="Torch engine: save the start-up calibration of the cost model under "
        "cache_dir and, at the next start, reuse it when a few cheap steps confirm it "
        "(a warm start in ~1 s instead of ~4.5 s; docs/admission.md).",
    )
    engine_compile: Literal["off", "decode"] = Field(
        "decode",
        description="Torch engine: decode answers through a compiled step (AOTInductor; "
        "built once per model and cache shape by a background process at idle priority, "
        "cached under cache_dir, loaded in seconds at later starts; eager until ready). "
        "Seeded answers keep their bits across preemption and resume either way "
        "(docs/engine.md); off: always eager.",
    )
    kv_cache_memory: str = Field(
        "auto",
        description="Memory of the torch engine's KV cache, allocated in full at start: a "
        "size (512MiB, 2GiB, 1.5GB, 800000000 bytes) or auto, what max_num_seqs x "
        "max_model_len positions need but at most 25% of MemTotal and 50% of MemAvailable, "
        "never below one sequence. Slots that do not fit are not served: the engine runs "
        "min(max_num_seqs, budget / one sequence's need) sequences at once.",
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _check_kv_cache_memory(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a YAML number: bytes
        if isinstance(value, str):
            try:
                parse_memory_size(value)
            except ValueError as exc:
                raise ValueError(f"kv_cache_memory {exc}") from None
            return value.strip()
        return value

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """``kv_cache_memory`` in bytes; None for ``auto`` (the engine applies the rule)."""
        return parse_memory_size(self.kv_cache_memory)
