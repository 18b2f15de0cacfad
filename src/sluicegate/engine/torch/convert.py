"""Checkpoint layouts: Hugging Face Llama (and Qwen2, Qwen3) names <-> this package's
fused layout."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from sluicegate.engine.families import SUPPORTED_MODEL_TYPES
from sluicegate.engine.torch.model_args import ModelArgs, RopeScaling, windowed_layers


def unpermute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from the "rotate half" layout
    (``[x0..x_{d/2-1}, y0..]``) to interleaved pairs (``[x0, y0, x1, y1, ...]``), because
    its rotary kernel rotates adjacent pairs.  Our RoPE is Hugging Face's rotate-half, so
    the rows go back: ``[H, d/2, 2, in] -> [H, 2, d/2, in]``.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])  # [H, d/2, 2, in]
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def unfused(args: ModelArgs, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: weight}``, or Phi-3's fused projections (``self_attn.qkv_proj``,
    ``mlp.gate_up_proj``) cut into Hugging Face's separate ones: the query, key and value
    rows; the MLP's gate rows, then its up rows."""
    prefix, _, leaf = name.rpartition(".self_attn.")
    if leaf == "qkv_proj.weight":
        sizes = [args.n_heads * args.head_dim, *[args.n_kv_heads * args.head_dim] * 2]
        parts = torch.split(weight, sizes)
        return {f"{prefix}.self_attn.{x}_proj.weight": w for x, w in zip("qkv", parts, strict=True)}
    prefix, _, leaf = name.rpartition(".mlp.")
    if leaf == "gate_up_proj.weight":
        gate, up = weight.chunk(2)
        return {f"{prefix}.mlp.gate_proj.weight": gate, f"{prefix}.mlp.up_proj.weight": up}
    return {name: weight}


def split_fused(
    args: ModelArgs, get: Callable[[str], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """``get`` for a checkpoint with Phi-3's fused projections: the separate Hugging Face
    names, cut from them (:func:`unfused`)."""

    def cut(name: str) -> torch.Tensor:
        prefix, _, leaf = name.rpartition(".self_attn.")
        fused = None
        if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            fused = f"{prefix}.self_attn.qkv_proj.weight"
        prefix, _, leaf = name.rpartition(".mlp.")
        if leaf in ("gate_proj.weight", "up_proj.weight"):
            fused = f"{prefix}.mlp.gate_up_proj.weight"
        return get(name) if fused is None else unfused(args, fused, get(fused))[name]

    return cut


def fuse_layer_weights(
    args: ModelArgs, get: Callable[[str], torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Build our state dict from Hugging Face names (``model.layers.0.self_attn.q_proj...``)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous()

    sd: dict[str, torch.Tensor] = {
        "tok_embeddings.weight": cast(get("model.embed_tokens.weight")),
        "norm.weight": cast(get("model.norm.weight")),
    }
    if not args.tie_word_embeddings:
        sd["output.weight"] = cast(get("lm_head.weight"))
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        q = get(p + "self_attn.q_proj.weight")  # [H * hd, D]
        k = get(p + "self_attn.k_proj.weight")  # [KVH * hd, D]
        v = get(p + "self_attn.v_proj.weight")  # [KVH * hd, D]
        gate = get(p + "mlp.gate_proj.weight")  # [I, D]
        up = get(p + "mlp.up_proj.weight")  # [I, D]
        o = f"layers.{i}."
        sd[o + "attention_norm.weight"] = cast(get(p + "input_layernorm.weight"))
        if args.gemma:  # its post_attention_layernorm norms the attention's output
            sd[o + "attention_post_norm.weight"] = cast(get(p + "post_attention_layernorm.weight"))
            sd[o + "ffn_norm.weight"] = cast(get(p + "pre_feedforward_layernorm.weight"))
            sd[o + "ffn_post_norm.weight"] = cast(get(p + "post_feedforward_layernorm.weight"))
        else:
            sd[o + "ffn_norm.weight"] = cast(get(p + "post_attention_layernorm.weight"))
        sd[o + "attention.wqkv.weight"] = cast(torch.cat([q, k, v], dim=0))
        if args.attention_bias:
            biases = [get(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
            sd[o + "attention.qkv_bias"] = cast(torch.cat(biases))
        if args.qk_norm:
            sd[o + "attention.q_norm.weight"] = cast(get(p + "self_attn.q_norm.weight"))
            sd[o + "attention.k_norm.weight"] = cast(get(p + "self_attn.k_norm.weight"))
        sd[o + "attention.wo.weight"] = cast(get(p + "self_attn.o_proj.weight"))
        sd[o + "feed_forward.w_gate_up.weight"] = cast(torch.cat([gate, up], dim=0))
        sd[o + "feed_forward.w_down.weight"] = cast(get(p + "mlp.down_proj.weight"))
    return sd


def to_hf_state_dict(
    args: ModelArgs, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_layer_weights`: Hugging Face ``LlamaForCausalLM`` names."""
    if args.gemma:
        raise ValueError("Gemma's layout is read, not written")
    hd = args.head_dim
    out = {
        "model.embed_tokens.weight": state_dict["tok_embeddings.weight"],
        "model.norm.weight": state_dict["norm.weight"],
        "lm_head.weight": state_dict.get("output.weight", state_dict["tok_embeddings.weight"]),
    }
    for i in range(args.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        q, k, v = torch.split(
            state_dict[o + "attention.wqkv.weight"],
            [args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd],
        )
        gate, up = state_dict[o + "feed_forward.w_gate_up.weight"].chunk(2)
        out |= {
            p + "input_layernorm.weight": state_dict[o + "attention_norm.weight"],
            p + "post_attention_layernorm.weight": state_dict[o + "ffn_norm.weight"],
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": state_dict[o + "attention.wo.weight"],
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": state_dict[o + "feed_forward.w_down.weight"],
        }
        if args.attention_bias:
            biases = torch.split(
                state_dict[o + "attention.qkv_bias"],
                [args.n_heads * hd, args.n_kv_heads * hd, args.n_kv_heads * hd],
            )
            out |= {p + f"self_attn.{n}_proj.bias": b for n, b in zip("qkv", biases, strict=True)}
        if args.qk_norm:
            out[p + "self_attn.q_norm.weight"] = state_dict[o + "attention.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = state_dict[o + "attention.k_norm.weight"]
    return out


def hf_config_dict(args: ModelArgs) -> dict[str, Any]:
    """A ``LlamaConfig``-compatible dict for these args (``Qwen2Config`` with attention
    biases, ``Qwen3Config`` with query and key norms; tests build the reference from it)."""
    family = "qwen3" if args.qk_norm else "qwen2" if args.attention_bias else "llama"
    config: dict[str, Any] = {
        "model_type": family,
        "architectures": [f"{family.capitalize()}ForCausalLM"],
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": args.attention_bias and family != "qwen2",
        "mlp_bias": False,
    }
    if args.sliding_window is not None:
        config["sliding_window"] = args.sliding_window
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": s.rope_type,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return config


#: Gemma 3: one layer in this many attends to the whole context, the others within the
#: window, turning by a RoPE base of their own (these, unless the config says otherwise).
GEMMA3_WINDOW_PERIOD = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
#: What a Gemma 3 ``text_config`` leaves out, :class:`transformers.Gemma3TextConfig`'s
#: defaults (the 4B, 12B and 27B checkpoints' configs name only what differs).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": GEMMA3_WINDOW_PERIOD,
    "tie_word_embeddings": True,
}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's part of a ``config.json``: Gemma 3's multimodal checkpoints
    (``model_type`` ``gemma3``) keep it under ``text_config``, with defaults left out."""
    if config.get("model_type") != "gemma3":
        return dict(config)
    text = config.get("text_config") or {}
    return GEMMA3_TEXT_DEFAULTS | dict(text) | {"model_type": "gemma3_text"}


def hf_model_args(config: Mapping[str, Any]) -> ModelArgs:
    """``ModelArgs`` from a Hugging Face ``config.json`` of a Llama-architecture model
    (Llama, Mistral, Qwen2 and Qwen2.5, Qwen3, Phi-3, Gemma 2, Gemma 3's language model)."""
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    config = text_config(config)
    model_type = config.get("model_type", "llama")
    qwen = model_type in ("qwen2", "qwen3")
    gemma3 = model_type == "gemma3_text"
    # Qwen2 always has query, key and value biases (its config has no flag for them).
    attention_bias = model_type == "qwen2" or bool(config.get("attention_bias"))
    if config.get("mlp_bias") or (attention_bias and not qwen):
        raise ValueError(f"unsupported architecture {model_type!r} with projection biases")
    # Qwen configs name a window but use it only with use_sliding_window.
    window = config.get("sliding_window")
    if qwen and not config.get("use_sliding_window"):
        window = None
    gemma = model_type in ("gemma2", "gemma3_text")
    activation = config.get("hidden_activation" if gemma else "hidden_act", "silu")
    if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"unsupported activation {activation!r} for {model_type!r}")
    n_heads = int(config["num_attention_heads"])
    n_layers = int(config["num_hidden_layers"])
    dim = int(config["hidden_size"])
    rope, local_theta = _rope(config)
    partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial rotary embeddings ({partial}) are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type in ("linear", "llama3"):
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", config["max_position_embeddings"])
            ),
        )
    elif rope_type != "default":
        raise ValueError(f"unsupported rope scaling {rope_type!r}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or dim // n_heads),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
        rope_scaling=scaling,
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3" or gemma3,
        sliding_window=int(window) if window else None,
        sliding_layers=_sliding_layers(config, model_type, n_layers) if window else None,
        rope_local_theta=local_theta if gemma3 else None,
        gemma=gemma,
        query_pre_attn_scalar=_number(config.get("query_pre_attn_scalar")) if gemma else None,
        attn_logit_softcapping=_number(config.get("attn_logit_softcapping")) if gemma else None,
        final_logit_softcapping=_number(config.get("final_logit_softcapping")) if gemma else None,
    )


def _rope(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], float | None]:
    """The rotation of the layers that see the whole context (its scaling and base), and
    the windowed layers' own base where it differs (Gemma 3).  Configs say it as
    ``rope_scaling`` and ``rope_theta`` (and Gemma 3's ``rope_local_base_freq``), or as
    ``rope_parameters``, flat or by layer type (transformers 5)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    local = config.get("rope_local_base_freq")
    if "full_attention" in rope:  # by layer type
        sliding = rope.get("sliding_attention") or {}
        local = sliding.get("rope_theta", local)
        rope = rope["full_attention"]
    return rope, _number(local)


def _sliding_layers(config: Mapping[str, Any], model_type: str, n_layers: int) -> tuple[int, ...]:
    """The layers that attend within the window: as ``layer_types`` says (transformers
    writes it since 4.53), else by each family's own rule (Gemma 2 every other layer from
    the first, Gemma 3 all but every ``sliding_window_pattern``-th, Qwen from
    ``max_window_layers``, the others every layer)."""
    types = config.get("layer_types")
    if types:
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if model_type == "gemma2":
        return windowed_layers(n_layers, 2)
    if model_type == "gemma3_text":
        period = int(config.get("sliding_window_pattern") or GEMMA3_WINDOW_PERIOD)
        return windowed_layers(n_layers, period)
    if model_type in ("qwen2", "qwen3"):
        return tuple(range(int(config.get("max_window_layers", n_layers)), n_layers))
    return tuple(range(n_layers))


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
