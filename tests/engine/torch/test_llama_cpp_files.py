"""GGUF files as llama.cpp itself writes them, read as llama.cpp reads them: tiny random
Llama, Phi-3, Gemma 2 and Gemma 3 models with SentencePiece tokenizers (trained here),
and Qwen3 and Llama 3.1 ones with SmolLM2's byte-level BPE tokenizer, are converted by
llama.cpp's own ``convert_hf_to_gguf.py``; the engine's logits are transformers' on the
source model, its token ids ``llama-server``'s ``/tokenize``, and its greedy answer
``llama-server``'s, past Gemma's sliding window.

Needs a llama.cpp source tree (``SLUICEGATE_LLAMA_CPP_SOURCE``: the ``vendor/llama.cpp``
directory of the ``llama-cpp-python`` sdist) and a ``llama-server`` built from it
(``SLUICEGATE_LLAMA_SERVER``; docs/upstream.md says how); skipped without them (CI never
builds them).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import sentencepiece as spm
import torch

from tests.engine.torch.test_gguf_sentencepiece import DOCS, TEXTS
from tests.upstream.test_peers import Peer

pytestmark = [pytest.mark.slow, pytest.mark.model]

SOURCE = Path(os.environ.get("SLUICEGATE_LLAMA_CPP_SOURCE", "/nonexistent"))
BINARY = os.environ.get("SLUICEGATE_LLAMA_SERVER") or shutil.which("llama-server")
if not (SOURCE / "convert_hf_to_gguf.py").is_file() or not BINARY:
    pytest.skip(
        "no llama.cpp source and llama-server (set SLUICEGATE_LLAMA_CPP_SOURCE and "
        "SLUICEGATE_LLAMA_SERVER; docs/upstream.md)",
        allow_module_level=True,
    )

transformers = pytest.importorskip("transformers")
PROMPT = "What is backpressure in a serving system?"
#: Logits this close are a tie between llama.cpp's float32 and the engine's.
TIE = 1e-4
#: Each family's turn markers (llama.cpp's loader of a Phi-3 vocabulary looks its own up).
SYMBOLS = {
    "gemma2": ["<start_of_turn>", "<end_of_turn>"],
    "gemma3": ["<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"],
}
MARKED = "<start_of_turn>user\nHi<end_of_turn>"


def write_model(kind: str, out: Path) -> Any:
    """A tiny random ``kind`` (``llama``, ``phi3``, ``gemma2``, ``gemma3``) model, its
    SentencePiece tokenizer trained on the docs as the published ones are configured
    (Gemma's without the space prefix, its turn markers special), saved as transformers
    saves it."""
    gemma = kind.startswith("gemma")
    lines = [
        line
        for path in sorted(DOCS.glob("*.md"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        model_type="bpe",
        vocab_size=700,
        byte_fallback=True,
        character_coverage=0.995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=not gemma,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=SYMBOLS.get(kind, []),
        bos_piece="<bos>" if gemma else "<s>",
        eos_piece="<eos>" if gemma else "</s>",
        unk_id=0,
        bos_id=2 if gemma else 1,
        eos_id=1 if gemma else 2,
        pad_id=3 if gemma else -1,
        minloglevel=2,
    )
    out.mkdir(parents=True)
    (out / "tokenizer.model").write_bytes(proto.getvalue())
    common = dict(
        vocab_size=700,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    if gemma:
        config = transformers.Gemma3TextConfig(
            **common,
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=3,
        )
        model: Any = transformers.Gemma3ForCausalLM(config)
    elif kind == "gemma2":
        config = transformers.Gemma2Config(
            **common,
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=3,
        )
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "phi3":
        config = transformers.Phi3Config(
            **common, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=None
        )
        model = transformers.Phi3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(
            **common, num_hidden_layers=2, bos_token_id=1, eos_token_id=2
        )
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.3 if "norm" in name else 0.1)
            if "norm" in name and not gemma:
                parameter.add_(1.0)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_config: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>" if gemma else "<s>",
        "eos_token": "<eos>" if gemma else "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "GemmaTokenizer" if gemma else "LlamaTokenizer",
    }
    if gemma:  # as Gemma's own: the turn markers are special tokens
        tokenizer_config["added_tokens_decoder"] = {
            str(i): {"content": text, "special": True}
            for i, text in ((4, "<start_of_turn>"), (5, "<end_of_turn>"))
        }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model.config._attn_implementation = "eager"
    return model.eval()


def write_bpe(kind: str, tokenizer_dir: Path, out: Path) -> Any:
    """A tiny random Qwen2, Qwen3 or Llama 3.1 model beside SmolLM2's tokenizer files (its
    query, key and value biases or its query and key norms made large enough to matter;
    the Llama's RoPE scaled as Llama 3.1's, its original context short enough for the
    tiny model's frequencies to fall in all three of its bands)."""
    classes = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama3": "Llama"}
    extra: dict[str, Any] = {}
    if kind == "llama3":
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    config = getattr(transformers, f"{classes[kind]}Config")(
        **extra,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model: Any = getattr(transformers, f"{classes[kind]}ForCausalLM")(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                parameter.normal_(0.0, 0.5).add_(1.0 if "norm" in name else 0.0)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    model.config._attn_implementation = "eager"
    return model.eval()


def convert(directory: Path, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(SOURCE / "gguf-py")}
    command = [sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(directory)]
    command += ["--outtype", "f32", "--outfile", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# Not Qwen2: its converter does not know SmolLM2's pre-tokenizer (Qwen3's takes it).
@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma2", "gemma3", "qwen3", "llama3"])
def test_llama_cpp_s_own_files_read_as_llama_cpp_reads_them(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from sluicegate.engine.torch import TorchEngine
    from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch

    if kind in ("qwen3", "llama3"):
        tokenizer_dir = request.getfixturevalue("smollm2_hf_dir")
        reference = write_bpe(kind, tokenizer_dir, tmp_path / kind)
    else:
        reference = write_model(kind, tmp_path / kind)
    gguf = convert(tmp_path / kind, tmp_path / f"{kind}.gguf")
    engine = TorchEngine(
        str(gguf),
        dtype="float32",
        max_num_seqs=1,
        max_model_len=256,
        num_threads=1,
        cache_dir=str(tmp_path / "cache"),
    )
    args = [str(BINARY), "-m", str(gguf), "-t", "1", "-c", "512"]
    peer = Peer("llama-server", args, {}, model=gguf.name)
    try:
        peer.wait()
        with httpx.Client(base_url=peer.base_url, timeout=60) as client:
            for text in [*TEXTS, MARKED]:
                body = {"content": text, "add_special": False, "parse_special": True}
                theirs = client.post("/tokenize", json=body).json()["tokens"]
                ours = engine.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
                assert ours == theirs, text
            body = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "ignore_eos": True}
            body |= {"cache_prompt": False, "return_tokens": True}
            expected = client.post("/completion", json=body).json()
        ids = engine.tokenizer.encode(PROMPT)
        with torch.inference_mode():
            logits = reference(torch.tensor([ids])).logits[0]
            batch, _ = build_batch([SequenceChunk(0, 0, len(ids), len(ids))])
            torch.testing.assert_close(engine.model(torch.tensor(ids), batch), logits)
            # llama-server's greedy answer, token by token: each is the engine's greedy
            # choice too, but where two logits tie within float32's rounding of two
            # different arithmetics (a random model's are close together); neither ends
            # the answer (ignore_eos: llama-server never picks an end-of-turn or -text
            # token, which the engine's end-of-sequence ids must then be).
            ends = list(engine.tokenizer.eos_token_ids)
            row = logits[-1].clone()
            for position, token in enumerate(expected["tokens"], start=len(ids)):
                row[ends] = float("-inf")
                assert row[token] >= row.max() - TIE, (position, token, int(row.argmax()))
                batch, _ = build_batch([SequenceChunk(0, position, 1, 1)])
                row = engine.model(torch.tensor([token]), batch)[-1]
        assert len(expected["tokens"]) == 16  # past the window of 8
    finally:
        peer.stop()
        engine.close()
