"""A checkpoint's shape and constants (:class:`ModelArgs`), and the rotary embeddings
they define: what :mod:`~sluicegate.engine.torch.model` builds its modules from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor

from sluicegate.engine.torch.attention_batch import cache_positions


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary frequency scaling (Hugging Face ``rope_scaling``): ``linear`` or ``llama3``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Shape and constants of a Llama-family checkpoint."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    #: Qwen2's biases on the query, key and value projections.
    attention_bias: bool = False
    #: Qwen3's RMS norms of each query and key head, before the rotation.
    qk_norm: bool = False
    #: A sliding attention window (Mistral, Phi-3, Qwen with it on, Gemma 2 and 3): a
    #: query attends to itself and the ``sliding_window - 1`` positions before it.
    sliding_window: int | None = None
    #: The layers that attend within the window (Gemma's alternate with layers that attend
    #: to the whole context); None: every layer, when there is a window.
    sliding_layers: tuple[int, ...] | None = None
    #: Gemma 3's RoPE base of its windowed layers (unscaled); None: they rotate as the
    #: others do.
    rope_local_theta: float | None = None
    #: Each rotary frequency's divisor, as llama.cpp writes Llama 3.1's scaling into a GGUF
    #: file (``rope_freqs.weight``: its ``llama3`` parameters are not kept); None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    #: Gemma 2's layout (and Gemma 3's): norms scale by ``1 + w`` (in float32), the
    #: attention's and the MLP's outputs are normed again before their residuals, the
    #: embeddings are scaled by ``sqrt(dim)``, the MLP's gate is GeLU (tanh); and its
    #: constants: the query scale's denominator, and the soft caps of attention scores and
    #: of the logits.
    gemma: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def max_context(self) -> int:
        """The longest context this engine serves the model at: the one it was trained
        with (a sliding window masks the keys before it, at any length)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None: the whole context)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates by the windowed layers' own base (Gemma 3)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("rotary embeddings need an even head_dim")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArgs:
        values = dict(data)
        scaling = values.pop("rope_scaling", None)
        for name in ("sliding_layers", "rope_freq_factors"):  # JSON lists
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values, rope_scaling=RopeScaling(**scaling) if scaling else None)


def windowed_layers(n_layers: int, period: int) -> tuple[int, ...]:
    """The windowed layers when all but every ``period``-th one are (Gemma 2: every other
    one from the first; Gemma 3: five in six)."""
    return tuple(i for i in range(n_layers) if (i + 1) % period)


def rope_inverse_frequencies(args: ModelArgs) -> Tensor:
    """``inv_freq`` ``[head_dim / 2]`` exactly as Hugging Face computes it (float32)."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (args.rope_theta**exponents)  # [hd/2]
    if args.rope_freq_factors is not None:
        return inv_freq / torch.tensor(args.rope_freq_factors, dtype=torch.float32)
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(args: ModelArgs, length: int) -> tuple[Tensor, Tensor]:
    """``cos, sin`` ``[length, head_dim]`` in float32 (the halves repeated, HF layout)."""
    positions = torch.arange(length, dtype=torch.float32)  # [L]
    freqs = positions[:, None] * rope_inverse_frequencies(args)[None, :]  # [L, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, hd]
    return emb.cos(), emb.sin()


def local_rope_tables(args: ModelArgs, length: int) -> tuple[Tensor, Tensor] | None:
    """The windowed layers' own ``cos, sin`` tables (Gemma 3: another base, no scaling);
    None when they rotate as the others do."""
    if args.rope_local_theta is None:
        return None
    local = replace(
        args, rope_theta=args.rope_local_theta, rope_scaling=None, rope_freq_factors=None
    )
    return rope_tables(local, length)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[T, H, hd]`` by ``cos, sin`` ``[T, 1, hd]``.

    Computed in float32 whatever the model dtype: positions far into the context need the
    precision, and q/k are small next to the weights.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # [T, H, hd/2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [T, H, hd]
    return (xf * cos + rotated * sin).to(x.dtype)


def kv_cache_bytes_per_slot(args: ModelArgs, max_model_len: int, dtype: torch.dtype) -> int:
    """Bytes of one slot of the KV cache: keys and values of every layer over
    ``max_model_len`` positions, padded as :meth:`Transformer.setup_caches` pads them."""
    positions = cache_positions(max_model_len)
    return args.n_layers * 2 * args.n_kv_heads * positions * args.head_dim * dtype.itemsize
