"""SentencePiece tokenizers of GGUF files (Llama 2, TinyLlama, Mistral, Gemma, Phi-3):
rebuilt from the vocabulary, scores and token types llama.cpp's converter writes, they
tokenize as SentencePiece itself does.

The models are trained here on this repository's documentation, as the published ones
are configured (BPE, byte fallback, no normalisation, digits split; a space put before the
text as Llama's do, or not as Gemma's), and written into GGUF metadata as llama.cpp's
``convert_hf_to_gguf.py`` writes a ``tokenizer.model`` (each piece, its score and type).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from sluicegate.engine.torch.tokenizer_build import GGUFTokenizerSpec, build_gguf_tokenizer

pytestmark = pytest.mark.slow

DOCS = Path(__file__).resolve().parents[3] / "docs"
#: gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "double  spaces   and a trailing one ",
    "It's what we'll do; they'd've known.",
    "numbers 12345, 3.14159 and -42",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 😀👍🏽",
    "backpressure: downstream capacity governs upstream production",
    "def f(x):\n    return x ** 2  # square\n",
    "",
    " ",
    "a",
]


def train(add_space_prefix: bool, **options: Any) -> Any:
    """A 700-piece SentencePiece BPE model of this repository's docs (``options``: the
    trainer's, over these)."""
    lines = [
        line
        for path in sorted(DOCS.glob("*.md"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=700,
        byte_fallback=True,
        character_coverage=0.995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_space_prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        **({"user_defined_symbols": ["<start_of_turn>", "<end_of_turn>"]} | options),
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_spec(sp: Any, add_space_prefix: bool) -> GGUFTokenizerSpec:
    """The GGUF metadata llama.cpp's converter writes for ``sp``, as the loader reads it."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_unused(i):
            types.append(UNUSED)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif tokens[-1] in ("<start_of_turn>", "<end_of_turn>"):
            types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
    return GGUFTokenizerSpec.from_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": sp.bos_id(),
            "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix,
        }
    )


@pytest.mark.parametrize("add_space_prefix", [True, False], ids=["llama", "gemma"])
def test_ids_and_text_are_sentencepieces(add_space_prefix: bool) -> None:
    sp = train(add_space_prefix)
    tok = build_gguf_tokenizer(gguf_spec(sp, add_space_prefix))
    fell_back = False
    for text in TEXTS:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == expected, text
        assert tok.decode(expected) == sp.decode(expected), text
        fell_back |= any(sp.is_byte(i) for i in expected)
    assert fell_back  # some characters were spelled as their bytes
    # A turn marker is one token, matched whole, with the text around it as SentencePiece
    # tokenizes each side.
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False).ids
    marker = sp.piece_to_id("<start_of_turn>")
    assert ids[0] == marker and sp.piece_to_id("<end_of_turn>") == ids[-1]


@pytest.mark.parametrize("add_space_prefix", [True, False], ids=["llama", "gemma"])
def test_a_gguf_file_with_a_sentencepiece_tokenizer(add_space_prefix: bool, tmp_path: Path) -> None:
    """Read from a GGUF file as the server reads one (its fields, then the cached
    ``tokenizer.json`` of a second load): ids as SentencePiece's, after the BOS token, and
    a streamed answer's text as SentencePiece decodes it."""
    import gguf

    from sluicegate.engine.torch.loader import load_tokenizer

    sp = train(add_space_prefix)
    spec = gguf_spec(sp, add_space_prefix)
    path = tmp_path / "tiny-spm.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(spec.tokens)
    writer.add_token_scores(spec.scores or [])
    writer.add_token_types(spec.token_types or [])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for _ in range(2):  # converted, then from the cache
        tokenizer = load_tokenizer(path, tmp_path / "cache")
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert ids == [sp.bos_id(), *sp.encode(text)], text
            stream = tokenizer.decode_stream()
            streamed = "".join(stream.step(i) for i in ids[1:])
            assert streamed == sp.decode(ids[1:]), text


def test_an_end_of_turn_piece_is_a_control_token_whatever_its_type() -> None:
    """llama.cpp's converter writes a SentencePiece model's own pieces as normal ones when
    no added-token list says otherwise, and llama.cpp then takes ``<end_of_turn>`` (and
    the other end-of-turn texts) as control tokens by their text: so does the engine,
    which stops an answer there; ``<start_of_turn>`` stays spelled out, as llama.cpp
    spells it (both checked against llama-server in test_llama_cpp_files.py)."""
    from dataclasses import replace

    from sluicegate.engine.torch.tokenizer_build import end_of_turn_ids

    sp = train(False)
    spec = gguf_spec(sp, False)
    markers = ("<start_of_turn>", "<end_of_turn>")
    types = [
        NORMAL if token in markers else kind
        for token, kind in zip(spec.tokens, spec.token_types or [], strict=True)
    ]
    tok = build_gguf_tokenizer(replace(spec, token_types=types))
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>", add_special_tokens=False).ids
    end = sp.piece_to_id("<end_of_turn>")
    assert ids[-1] == end and sp.piece_to_id("<start_of_turn>") not in ids
    assert end_of_turn_ids(tok) == [end]
