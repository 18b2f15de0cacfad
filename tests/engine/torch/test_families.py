"""Qwen2 (Qwen2.5) and Qwen3 checkpoints, without a download: tiny random models
written by transformers' own ``save_pretrained`` beside SmolLM2's tokenizer and chat
template, and the same weights written as GGUF files with the ``gguf`` package (llama.cpp's
tensor names and metadata, SmolLM2's vocabulary); loaded as ``--model`` would load them,
their logits are the ones transformers computes, and each is served end to end through
the official client.
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

transformers = pytest.importorskip("transformers")

#: SmolLM2's vocabulary (the tokenizer the tiny models are written with).
VOCAB = 49152
ROPE_THETA = 10000.0
FAMILIES = ("qwen2", "qwen3", "mistral", "phi3", "gemma2")
#: Families llama.cpp writes GGUF files of that the engine reads (Phi-3's fuses its
#: projections under names of its own: read from directories only).
GGUF_FAMILIES = ("qwen2", "qwen3")
#: The tiny Mistral's sliding window: it is served with no longer a context.
WINDOW = 96
#: What a directory holds besides its weights and config: SmolLM2's tokenizer, template
#: and end-of-sequence tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_hf_dir: Path) -> Path:
    """SmolLM2's directory: only its tokenizer's files are taken (:data:`TOKENIZER_FILES`)."""
    return smollm2_hf_dir


def write_tiny(family: str, tokenizer_dir: Path, out: Path) -> torch.nn.Module:
    """A 2-layer random ``family`` model saved by transformers into ``out`` (with the
    tokenizer's files); returns the model, in float32, as transformers runs it."""
    kinds = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3"}
    kind = kinds.get(family, "Gemma2")
    extra: dict[str, Any] = {"head_dim": 16} if family != "phi3" else {}
    if family == "mistral":
        extra["sliding_window"] = WINDOW
    if family == "gemma2":
        # Its query scale's own constant (256 in Gemma 2 2B), and soft caps small enough
        # to bend a tiny model's scores and logits (50 and 30 in Gemma 2).
        extra |= {
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        }
    config = getattr(transformers, f"{kind}Config")(
        **extra,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=family != "phi3",
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model: Any = getattr(transformers, f"{kind}ForCausalLM")(config)
    # Larger than the default init, so that a missing bias or norm moves the logits.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                parameter.normal_(0.0, 0.5).add_(1.0 if "norm" in name else 0.0)
            elif family == "gemma2":  # norms stored as w, applied as 1 + w
                parameter.normal_(0.0, 0.3 if "norm" in name else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    model.config._attn_implementation = "eager"
    result: torch.nn.Module = model.eval()
    return result


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_path: str) -> list[tuple[str, Any, Any, Any]]:
    """The SmolLM2 GGUF's ``tokenizer.*`` fields (name, value, type, element type), read
    once: every GGUF written here carries them."""
    import gguf

    fields = []
    for name, field in gguf.GGUFReader(smollm2_path).fields.items():
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
    writer = gguf.GGUFWriter(out, family)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for name, value, kind, sub_type in tokenizer:
        writer.add_key_value(name, value, kind, sub_type)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
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
    for x in "qkv":
        layer_names[f"self_attn.{x}_proj.weight"] = f"attn_{x}.weight"
        layer_names[f"self_attn.{x}_proj.bias"] = f"attn_{x}.bias"
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        if name in names:
            target = names[name]
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{layer_names[leaf]}"
        writer.add_tensor(target, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


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


@pytest.mark.parametrize("tiny", ["mistral"], indirect=True)
def test_a_model_with_a_sliding_window_is_served_within_it(tiny: Tiny) -> None:
    from sluicegate.engine.torch import TorchEngine

    with pytest.raises(ValueError, match="sliding attention window"):
        TorchEngine(str(tiny.directory), dtype="float32", max_model_len=WINDOW + 1)


def assert_logits(tiny: Tiny, path: Path, tmp_path: Path) -> None:
    """The engine's logits for a chat prompt are transformers' (within 1e-4)."""
    from sluicegate.engine.torch import TorchEngine

    context = WINDOW if tiny.family == "mistral" else 128
    engine = TorchEngine(
        str(path),
        dtype="float32",
        max_num_seqs=2,
        max_model_len=context,
        num_threads=TEST_THREADS,
        cache_dir=str(tmp_path),
    )
    try:
        assert engine.args.attention_bias == (tiny.family == "qwen2")
        assert engine.args.qk_norm == (tiny.family == "qwen3")
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is a river?"}])
        with torch.inference_mode():
            expected = tiny.reference(torch.tensor([ids])).logits[0]  # [T, V]
            batch, _ = build_batch([SequenceChunk(0, 0, len(ids), True)])
            got = engine.model(torch.tensor(ids), batch)[-1]
        torch.testing.assert_close(got, expected[-1], atol=1e-4, rtol=1e-4)
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
        yield server.v1, tiny.directory.name, WINDOW if tiny.family == "mistral" else 512
    finally:
        server.stop()


def test_served_through_the_official_client(served: tuple[str, str, int]) -> None:
    base_url, model, context = served
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        listed = client.models.list().data[0]
        # Its own context: 512 positions, or the Mistral's sliding window.
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
