"""Qwen2 (Qwen2.5), Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3 checkpoints, without a
download: tiny random models written by transformers' own ``save_pretrained`` beside
SmolLM2's tokenizer and chat template, and the same weights written as GGUF files
with the ``gguf`` package (llama.cpp's tensor names and metadata, SmolLM2's vocabulary;
not Mistral's, which llama.cpp writes as a Llama's);
loaded as ``--model`` would load them, their logits are the ones transformers computes,
prompt chunks and decode steps alike (the windowed families' past their window), and
each is served end to end through the official client.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from tests.engine.torch.conftest import TEST_THREADS
from tests.support.servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.model]

#: SmolLM2's vocabulary (the tokenizer the tiny models are written with).
VOCAB = 49152
ROPE_THETA = 10000.0
FAMILIES = ("qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")
#: Families llama.cpp writes GGUF files of that the engine reads.
GGUF_FAMILIES = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3", "llama3")
#: Llama 3.1's RoPE scaling (GGUF files only: a directory's is tests/engine/torch/
#: test_model.py's), with an original context short enough that the tiny model's
#: frequencies fall in all three of its bands.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
#: The tiny Mistral's and Gemmas' sliding window: a chat prompt is several times longer.
WINDOW = 8
#: Families with a sliding window (Gemma's on every other layer).
WINDOWED = ("mistral", "gemma2", "gemma3")
#: What a directory holds besides its weights and config: SmolLM2's tokenizer, template
#: and end-of-sequence tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_hf_dir: Path) -> Path:
    """SmolLM2's directory: only its tokenizer's files are taken (:data:`TOKENIZER_FILES`)."""
    return smollm2_hf_dir


def write_tiny(
    family: str, tokenizer_dir: Path, out: Path, multimodal: bool = False
) -> torch.nn.Module:
    """A tiny random ``family`` model (:func:`tiny_model`) saved by transformers into
    ``out`` with the tokenizer's files; returns the model, in float32, as transformers runs
    it."""
    model = tiny_model(family, multimodal)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return model


def tiny_model(family: str, multimodal: bool = False, **config_values: Any) -> Any:
    """A 2-layer (Gemma 3: 6-layer) random ``family`` model over SmolLM2's vocabulary (or
    what ``config_values`` say otherwise), in float32, computing as transformers does with
    its eager attention (``multimodal``: Gemma 3's language model inside an
    image-and-text model, with a one-layer image encoder)."""
    kinds = {
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mistral": "Mistral",
        "phi3": "Phi3",
        "llama3": "Llama",
    }
    kind = kinds.get(family, family.capitalize())
    extra: dict[str, Any] = {"head_dim": 16} if family != "phi3" else {}
    extra["rope_theta"] = ROPE_THETA
    if family in WINDOWED:
        extra["sliding_window"] = WINDOW
    if family == "gemma2":
        # Its query scale's constant head_dim's (as in Gemma 2 2B and 9B: what a GGUF file
        # implies), and soft caps small enough to bend a tiny model's scores and logits
        # (50 and 30 in Gemma 2).
        extra |= {
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        }
    if family == "gemma3":
        # Five windowed layers to one over the whole context, as in every Gemma 3 (and as
        # llama.cpp assumes of a GGUF file), each kind with its own RoPE (the windowed
        # ones turn by 10,000, the others by 1,000,000, scaled in the larger models); no
        # cap on scores or logits; the query scale's constant head_dim's (as in every
        # Gemma 3 but the 27B: the one a GGUF file implies).
        del extra["rope_theta"]
        extra |= {
            "query_pre_attn_scalar": 16,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        }
    if family == "llama3":
        extra["rope_scaling"] = LLAMA3_SCALING
    config_class = "Gemma3TextConfig" if family == "gemma3" else f"{kind}Config"
    values: dict[str, Any] = {
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": family != "phi3",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    # Imported here: at collection it took each pytest worker ~1 s of CPU.
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_class)(**(values | extra | config_values))
    torch.manual_seed(0)
    if multimodal:
        vision = transformers.SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        config = transformers.Gemma3Config(
            text_config=config,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 2,
            eoi_token_index=VOCAB - 3,
        )
    model_class = "Gemma3ForConditionalGeneration" if multimodal else f"{kind}ForCausalLM"
    model: Any = getattr(transformers, model_class)(config)
    # Larger than the default init, so that a missing bias or norm moves the logits.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                parameter.normal_(0.0, 0.5).add_(1.0 if "norm" in name else 0.0)
            elif family.startswith("gemma"):  # norms stored as w, applied as 1 + w
                parameter.normal_(0.0, 0.3 if "norm" in name else 0.1)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_path: str) -> list[tuple[str, Any, Any, Any]]:
    """The SmolLM2 GGUF's ``tokenizer.*`` fields (name, value, type, element type), read
    once: every GGUF written here carries them."""
    import gguf

    from sluicegate.engine.torch.gguf_reader import FastGGUFReader

    fields = []
    for name, field in FastGGUFReader(smollm2_path).fields.items():
        if name.startswith("tokenizer."):
            types = field.types
            sub_type = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((name, field.contents(), types[0], sub_type))
    return fields


def write_gguf(
    family: str, reference: Any, tokenizer: list[tuple[str, Any, Any, Any]], out: Path
) -> Path:
    """``reference``'s weights as a float32 GGUF of architecture ``family``, with the
    ``tokenizer`` fields of the SmolLM2 GGUF (as llama.cpp's converter names things;
    Qwen's query and key rows are not reordered)."""
    import gguf

    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gemma = family.startswith("gemma")
    writer = gguf.GGUFWriter(out, "llama" if family == "llama3" else family)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family == "gemma3":  # the global layers' rotation (the windowed ones' is llama.cpp's)
        writer.add_rope_freq_base(1e6)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    else:
        writer.add_rope_freq_base(ROPE_THETA)
    if gemma:
        writer.add_sliding_window(WINDOW)
    if family == "phi3":  # llama.cpp's converter writes 0 for a model without a window
        writer.add_sliding_window(0)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for name, value, kind, sub_type in tokenizer:
        writer.add_key_value(name, value, kind, sub_type)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
    }
    if gemma:
        layer_names |= {
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        }
    for x in "qkv":
        layer_names[f"self_attn.{x}_proj.weight"] = f"attn_{x}.weight"
        layer_names[f"self_attn.{x}_proj.bias"] = f"attn_{x}.bias"
    # Phi-3's fused projections, kept fused.
    layer_names["self_attn.qkv_proj.weight"] = "attn_qkv.weight"
    layer_names["mlp.gate_up_proj.weight"] = "ffn_up.weight"
    if family == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(head_dim))
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied to the embedding
        if name in names:
            target = names[name]
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{layer_names[leaf]}"
        data = tensor.detach().float()
        if family == "llama3" and target.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in target else config.num_key_value_heads
            data = permute_rotary_rows(data, heads)
        if gemma and target.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's converter writes the scale Gemma applies, 1 + w
        writer.add_tensor(target, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def permute_rotary_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's reordering of a Llama's query or key rows for its rotary kernel (each
    head's halves interleaved), as its converter writes them."""
    half = weight.shape[0] // n_heads // 2
    w = weight.reshape(n_heads, 2, half, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def llama_cpp_rope_factors(head_dim: int) -> Any:
    """Llama 3.1's scaling as llama.cpp's converter writes it: a divisor per frequency."""
    import math

    import numpy as np

    s = LLAMA3_SCALING
    old = float(s["original_max_position_embeddings"])
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * ROPE_THETA ** (i / head_dim)
        if wavelength < high:
            factors.append(1.0)
        elif wavelength > low:
            factors.append(s["factor"])
        else:
            smooth = (old / wavelength - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


@dataclass(slots=True)
class Tiny:
    family: str
    reference: Any
    directory: Path
    gguf: Path


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(
    request: pytest.FixtureRequest,
    tokenizer_dir: Path,
    gguf_tokenizer: list[tuple[str, Any, Any, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Tiny:
    """One tiny random model of the family, as a directory and (Qwen) as a GGUF file."""
    family: str = request.param
    root = tmp_path_factory.mktemp(family)
    reference = write_tiny(family, tokenizer_dir, root / family)
    path = root / f"tiny-{family}.gguf"
    if family in GGUF_FAMILIES:
        write_gguf(family, reference, gguf_tokenizer, path)
    return Tiny(family, reference, root / family, path)


def test_a_directory_loads_with_the_logits_transformers_computes(
    tiny: Tiny, tmp_path: Path
) -> None:
    assert_logits(tiny, tiny.directory, tmp_path)


@pytest.mark.parametrize("tiny", GGUF_FAMILIES, indirect=True)
def test_a_gguf_file_loads_with_the_logits_transformers_computes(
    tiny: Tiny, tmp_path: Path
) -> None:
    assert_logits(tiny, tiny.gguf, tmp_path)


def test_a_multimodal_gemma_3_is_served_its_language_model(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Gemma 3's larger checkpoints hold an image encoder beside the language model (its
    tensors named under ``language_model.``, its config under ``text_config``): the text
    model is loaded, with the logits transformers computes for a text prompt."""
    directory = tmp_path / "gemma3-multimodal"
    reference = write_tiny("gemma3", tokenizer_dir, directory, multimodal=True)
    assert_logits(
        Tiny("gemma3", reference, directory, tmp_path / "unused.gguf"), directory, tmp_path
    )


def assert_logits(tiny: Tiny, path: Path, tmp_path: Path) -> None:
    """The engine's logits for a chat prompt are transformers' (within 1e-4): the prompt
    in two chunks, then its last tokens decoded one by one beside another sequence's
    (the second chunk and the decode steps are past a windowed family's window)."""
    from sluicegate.engine.torch import TorchEngine

    engine = TorchEngine(
        str(path),
        dtype="float32",
        max_num_seqs=2,
        max_model_len=128,
        num_threads=TEST_THREADS,
        cache_dir=str(tmp_path),
    )
    try:
        assert engine.args.attention_bias == (tiny.family == "qwen2")
        assert engine.args.qk_norm == (tiny.family in ("qwen3", "gemma3"))
        assert (engine.args.sliding_window == WINDOW) == (tiny.family in WINDOWED)
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is a river?"}])
        other = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        n, first = len(ids), WINDOW + 3
        assert n - 3 - first > WINDOW  # the second chunk is longer than the window
        with torch.inference_mode():
            expected = tiny.reference(torch.tensor([ids])).logits[0]  # [T, V]
            got = {}
            for start, length in ((0, first), (first, n - 3 - first)):
                batch, _ = build_batch([SequenceChunk(0, start, length, 1)])
                got[start + length - 1] = engine.model(
                    torch.tensor(ids[start : start + length]), batch
                )[-1]
            batch, _ = build_batch([SequenceChunk(1, 0, len(other), 0)])
            engine.model(torch.tensor(other), batch)
            for position in range(n - 3, n):  # beside the other sequence's decode steps
                chunks = [
                    SequenceChunk(1, len(other) + position - n + 3, 1, 1),
                    SequenceChunk(0, position, 1, 1),
                ]
                batch, order = build_batch(chunks)
                tokens = [ids[position] if i == 1 else ids[0] for i in order]
                got[position] = engine.model(torch.tensor(tokens), batch)[order.index(1)]
        for position, logits in got.items():
            torch.testing.assert_close(logits, expected[position], atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tiny: Tiny) -> Iterator[tuple[str, str, int]]:
    server = start_server(
        [
            *("--model", str(tiny.directory), "--dtype", "float32"),
            # No --max-model-len: the model's own context (under the 2,048 default).
            *("--max-num-seqs", "2", "--admission", "static"),
        ],
        tiny.family,
    )
    try:
        yield server.v1, tiny.directory.name, 512
    finally:
        server.stop()


def test_served_through_the_official_client(served: tuple[str, str, int]) -> None:
    base_url, model, context = served
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        listed = client.models.list().data[0]
        # Its own context: 512 positions (longer than any sliding window).
        assert listed.id == model and (listed.model_extra or {})["max_model_len"] == context
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8,
            temperature=0.0,
        )
        streamed = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=8,
            temperature=0.0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    # A random model says nothing sensible, but the same thing greedily, streamed or not.
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert reply.choices[0].message.content == text
