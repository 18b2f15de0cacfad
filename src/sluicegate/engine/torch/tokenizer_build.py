"""Building a ``tokenizers.Tokenizer`` from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: only the vocabulary, the merges, token types and
the name of llama.cpp's pre-tokenizer.  For byte-level BPE (``tokenizer.ggml.model ==
"gpt2"``, which SmolLM2 uses) that is enough to rebuild the Hugging Face tokenizer: the
tokens are already spelled in GPT-2's byte-to-unicode alphabet, and the pre-tokenizer name
tells which split regex the merges were learned with (llama.cpp's ``llama-vocab.cpp``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

#: Tokens that end an assistant turn or a document in common chat formats; those present
#: as special tokens join the model's eos ids so that chat answers stop.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)

# llama.cpp token types (gguf.TokenType)
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that are GPT-2's regex after isolating every digit (``\p{N}``).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"}
_QWEN2 = {"qwen2", "deepseek-r1-qwen"}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """The tokenizer part of a GGUF file's metadata."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int] | None
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> GGUFTokenizerSpec:
        def opt_int(key: str) -> int | None:
            value = md.get(key)
            return int(value) if value is not None else None

        types = md.get("tokenizer.ggml.token_type")
        template = md.get("tokenizer.chat_template")
        return cls(
            model=str(md.get("tokenizer.ggml.model", "")),
            pre=str(md["tokenizer.ggml.pre"]) if "tokenizer.ggml.pre" in md else None,
            tokens=[str(t) for t in md["tokenizer.ggml.tokens"]],
            token_types=[int(t) for t in types] if types is not None else None,
            merges=[str(m) for m in md.get("tokenizer.ggml.merges", [])],
            bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
            eot_token_id=opt_int("tokenizer.ggml.eot_token_id"),
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=str(template) if template is not None else None,
        )

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    name = (pre or "default").lower()
    if name in _DIGITS_THEN_GPT2:
        # What SmolLM2's own tokenizer.json says: each digit alone, then GPT-2's regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _LLAMA3_SPLIT if name in _LLAMA3 else _QWEN2_SPLIT if name in _QWEN2 else None
    if split is None:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_gguf_tokenizer(spec: GGUFTokenizerSpec) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` equivalent to the one the GGUF was converted from."""
    if spec.model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {spec.model!r} is not supported (only byte-level BPE); "
            "use a Hugging Face model directory with a tokenizer.json instead"
        )
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    merges: list[tuple[str, str]] = []
    for merge in spec.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {merge!r}")
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(spec.pre)
    tok.decoder = decoders.ByteLevel()
    if spec.token_types is not None:
        # Control tokens (<|im_start|>, ...) must match whole in text and be skippable when
        # decoding; user-defined ones match whole but are ordinary text.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(spec.tokens, spec.token_types, strict=True)
            if kind == _CONTROL
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(spec.tokens, spec.token_types, strict=True)
            if kind == _USER_DEFINED
        ]
        if control:
            tok.add_special_tokens(control)
        if user:
            tok.add_tokens(user)
    return tok


def end_of_turn_ids(tok: Tokenizer) -> list[int]:
    """Ids of :data:`END_OF_TURN_TOKENS` that this tokenizer has as special tokens."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return [special[name] for name in END_OF_TURN_TOKENS if name in special]
