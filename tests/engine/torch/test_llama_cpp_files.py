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

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.engine.torch.test_families import tiny_model, write_tiny
from tests.engine.torch.test_gguf_sentencepiece import TEXTS, train
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
    """A tiny random ``kind`` (``llama``, ``phi3``, ``gemma2``, ``gemma3``) model with a
    SentencePiece tokenizer trained on the docs as the published ones are configured
    (Gemma's without the space prefix, its turn markers special), saved as transformers
    saves it."""
    gemma = kind.startswith("gemma")
    sp = train(
        not gemma,
        user_defined_symbols=SYMBOLS.get(kind, []),
        bos_piece="<bos>" if gemma else "<s>",
        eos_piece="<eos>" if gemma else "</s>",
        unk_id=0,
        bos_id=2 if gemma else 1,
        eos_id=1 if gemma else 2,
        pad_id=3 if gemma else -1,
    )
    out.mkdir(parents=True)
    (out / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": None}
    if gemma:
        ids["pad_token_id"] = sp.pad_id()
    model = tiny_model(kind, vocab_size=sp.get_piece_size(), tie_word_embeddings=gemma, **ids)
    with torch.no_grad():  # every weight, so that no logits tie by chance
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
    return model


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
        reference = write_tiny(kind, tokenizer_dir, tmp_path / kind)
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
