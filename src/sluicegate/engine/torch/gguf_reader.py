"""Reading a Llama-architecture GGUF file (``llama``, ``qwen2``, ``qwen3``, ``phi3``,
``gemma2``, ``gemma3``) into ``ModelArgs`` and a dequantised state dict."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from sluicegate.engine.families import SUPPORTED_GGUF_ARCHITECTURES
from sluicegate.engine.torch.convert import (
    GEMMA3_LOCAL_ROPE_THETA,
    GEMMA3_WINDOW_PERIOD,
    fuse_layer_weights,
    unfused,
    unpermute_rotary_rows,
)
from sluicegate.engine.torch.model_args import ModelArgs, RopeScaling, windowed_layers

#: Architectures whose query and key rows llama.cpp's converter reorders for its rotary
#: kernel (Llama's); Qwen's keep Hugging Face's layout (its rotation is NEOX-style).
PERMUTED_ARCHS = ("llama",)

# GGUF tensor names -> Hugging Face names (per layer: "blk.N." -> "model.layers.N.").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Qwen2's query, key and value biases; Qwen3's query and key norms.
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: Gemma's layers norm each sublayer's output too: llama.cpp names the attention's
#: ``post_attention_norm`` and the MLP's input norm ``ffn_norm``.
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GEMMA_ARCHS = ("gemma2", "gemma3")
#: Phi-3's projections stay fused under llama.cpp's names: cut apart as they are read.
_PHI3_LAYER_NAMES = _LAYER_NAMES | {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
#: What llama.cpp takes from the layer count rather than the file: the 27B models scale
#: queries by ``dim / n_heads`` rather than ``head_dim`` (Gemma 2's has 46 layers, Gemma
#: 3's 62); which layers are windowed (the families' rule, as in a directory's config),
#: and Gemma 3's windowed layers' RoPE base (newer converters write it:
#: ``gemma3.rope.freq_base_swa``).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_WINDOW_PERIOD = {"gemma2": 2, "gemma3": GEMMA3_WINDOW_PERIOD}


@dataclass(slots=True)
class GGUFFile:
    """Parsed metadata (plain Python values) and the file's tensors (memory-mapped)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor


class FastGGUFReader(GGUFReader):
    """``gguf``'s reader, slicing a plain array over the file's memory map rather than the
    ``numpy.memmap`` itself: it takes one slice per vocabulary entry (~250k for SmolLM2's
    49k tokens and merges), and each slice of a ``memmap`` runs its Python
    ``__array_finalize__``. SmolLM2's header in ~0.9 s of CPU instead of ~3.3 s
    (docs/engine-performance.md, "Start-up"); the same fields and tensors
    (``tests/engine/torch/test_smollm2.py``)."""

    def _get(
        self,
        offset: int,
        dtype: Any,
        count: int = 1,
        override_order: Any = None,
    ) -> Any:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        kind = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + kind.itemsize * count].view(dtype=kind)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def read_gguf(path: str | Path, with_tensors: bool = True) -> GGUFFile:
    """Parse the file (under a second of CPU for SmolLM2, most of it the 49k-token
    vocabulary)."""
    reader = FastGGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors} if with_tensors else {}
    return GGUFFile(Path(path), metadata, tensors)


def gguf_model_args(gguf: GGUFFile) -> ModelArgs:
    """``ModelArgs`` from llama.cpp's metadata keys (``llama.block_count``, ...)."""
    md = gguf.metadata
    arch = str(md.get("general.architecture"))
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (only {SUPPORTED_GGUF_ARCHITECTURES})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    dim = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length") or dim // n_heads)
    rope_dim = int(md.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    scaling = None
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type not in ("none", None):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    n_layers = int(key("block_count"))
    gemma = arch in GEMMA_ARCHS
    window = md.get(f"{arch}.attention.sliding_window") if gemma or arch == "phi3" else None
    window = int(window) if window else None  # llama.cpp writes 0 for none
    scalar = None
    if gemma:
        wide = n_layers == _GEMMA_27B_LAYERS[arch]
        scalar = float(dim // n_heads if wide else head_dim)
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(md.get(f"{arch}.attention.head_count_kv") or n_heads),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=int(md.get(f"{arch}.vocab_size") or len(md["tokenizer.ggml.tokens"])),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=scaling,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        sliding_window=window,
        sliding_layers=_sliding_layers(md, arch, n_layers) if window else None,
        rope_local_theta=(
            float(md.get(f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
            if arch == "gemma3"
            else None
        ),
        gemma=gemma,
        query_pre_attn_scalar=scalar,
        rope_freq_factors=_rope_freq_factors(gguf, head_dim),
        attn_logit_softcapping=_optional(md.get(f"{arch}.attn_logit_softcapping")),
        final_logit_softcapping=_optional(md.get(f"{arch}.final_logit_softcapping")),
    )


def _sliding_layers(md: dict[str, Any], arch: str, n_layers: int) -> tuple[int, ...] | None:
    """The windowed layers (None: every one): as newer converters say (a period, or a flag
    per layer), else llama.cpp's rule for the family (Phi-3: every layer)."""
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(i for i, flag in enumerate(pattern) if flag)
    period = int(pattern or _WINDOW_PERIOD.get(arch, 0))
    return windowed_layers(n_layers, period) if period else None


def _rope_freq_factors(gguf: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
    """Llama 3.1's RoPE scaling as llama.cpp writes it: a divisor per rotary frequency
    (``rope_freqs.weight``, ``head_dim / 2`` of them)."""
    tensor = gguf.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    factors = _dequantized(tensor).reshape(-1)
    if factors.numel() != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {factors.numel()} factors for {head_dim // 2}")
    return tuple(float(x) for x in factors)


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def _dequantized(tensor: Any) -> torch.Tensor:
    # gguf returns numpy in row-major [rows, cols] (GGUF lists shapes the other way round).
    array = dequantize(tensor.data, tensor.tensor_type)
    if not array.flags.writeable or array.dtype != np.float32:
        array = np.array(array, dtype=np.float32)  # a memory-mapped F32 tensor: copy it
    return torch.from_numpy(array)


def gguf_state_dict(gguf: GGUFFile, args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantise every tensor, undo llama.cpp's Q/K permutation and fuse, in ``dtype``."""
    arch = gguf.metadata.get("general.architecture")
    permuted = arch in PERMUTED_ARCHS
    layer_names = _ARCH_LAYER_NAMES.get(str(arch), _LAYER_NAMES)
    hf: dict[str, torch.Tensor] = {}
    for name, tensor in gguf.tensors.items():
        if name == "rope_freqs.weight":
            continue  # read into ModelArgs.rope_freq_factors
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            prefix, _, leaf = name.partition(".")
            layer, _, leaf = leaf.partition(".")
            if prefix != "blk" or leaf not in layer_names:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            hf_name = f"model.layers.{layer}.{layer_names[leaf]}"
        weight = _dequantized(tensor)
        if arch in GEMMA_ARCHS and name.endswith("norm.weight"):
            # llama.cpp's converter writes Gemma's norms as 1 + w, the scale they apply.
            weight = weight - 1.0
        if permuted and hf_name.endswith("q_proj.weight"):
            weight = unpermute_rotary_rows(weight, args.n_heads)
        elif permuted and hf_name.endswith("k_proj.weight"):
            weight = unpermute_rotary_rows(weight, args.n_kv_heads)
        hf.update(unfused(args, hf_name, weight))

    def get(name: str) -> torch.Tensor:
        try:
            return hf.pop(name)  # pop: free each float32 copy as soon as it is converted
        except KeyError:
            raise ValueError(f"GGUF file lacks the tensor for {name}") from None

    return fuse_layer_weights(args, get, dtype)
