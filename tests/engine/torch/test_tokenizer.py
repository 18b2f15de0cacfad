"""The SmolLM2 tokenizer rebuilt from GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.torch.loader import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.model]

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "It's what we'll do; they'd've known.",
    "numbers 12345, 3.14159 and -42",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square\n",
]


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str, tokenizer_cache: Path) -> TextTokenizer:
    """Built from the GGUF's metadata (the cache is empty: it parses the file)."""
    return load_tokenizer(smollm2_path, tokenizer_cache)


def test_ids_match_transformers_gguf_conversion(
    tokenizer: TextTokenizer, smollm2_path: str
) -> None:
    """transformers rebuilds the same BPE from the same metadata independently of us (with
    GPT-2's split; SmolLM2 also isolates digits, which its vocabulary makes equivalent)."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, spec, _ = get_gguf_tokenizer(smollm2_path)
    reference, _ = convert_gguf_tokenizer(architecture, spec)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_known_ids(tokenizer: TextTokenizer) -> None:
    tok = tokenizer.tokenizer
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    assert tokenizer.encode("<|im_start|>assistant\n")[0] == 1
    assert tokenizer.vocab_size == 49152
    assert tokenizer.add_bos_token_id is None
    assert tokenizer.eos_token_ids[0] == 2  # the GGUF eos, <|im_end|>, first
    # Digits are split one by one (llama.cpp's "smollm" pre-tokenizer).
    assert len(tokenizer.encode("2024")) == 4


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_round_trip(tokenizer: TextTokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_specials_are_single_tokens_and_skipped_in_decode(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"


def test_incremental_decoding_matches_full_decode(tokenizer: TextTokenizer) -> None:
    text = TEXTS[5] + " " + TEXTS[3]
    ids = tokenizer.encode(text)
    stream = tokenizer.decode_stream()
    assert "".join(stream.step(i) for i in ids) == text


def test_chat_template(tokenizer: TextTokenizer) -> None:
    rendered = tokenizer.chat_template.render([{"role": "user", "content": "Hi"}])
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with_system = tokenizer.chat_template.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[-4:] == tokenizer.encode("<|im_start|>assistant\n")


def test_cached_tokenizer_equals_freshly_built(
    tokenizer: TextTokenizer, smollm2_path: str, tokenizer_cache: Path
) -> None:
    """The fixture's tokenizer was built from the GGUF into an empty cache: the cache
    gives it back."""
    assert (next((tokenizer_cache / "torch").iterdir()) / "tokenizer.json").is_file()
    again = load_tokenizer(smollm2_path, tokenizer_cache)  # warm: reads tokenizer.json
    assert again.eos_token_ids == tokenizer.eos_token_ids
    assert again.chat_template.source == tokenizer.chat_template.source
    for text in TEXTS:
        assert again.encode(text) == tokenizer.encode(text)
