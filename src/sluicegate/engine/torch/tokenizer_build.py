"""Building a ``tokenizers.Tokenizer`` from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: only the vocabulary, the merges or scores, token
types and the name of llama.cpp's pre-tokenizer.  Two kinds are rebuilt:

* **byte-level BPE** (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen): the
  tokens are already spelled in GPT-2's byte-to-unicode alphabet, and the pre-tokenizer
  name tells which split regex the merges were learned with (llama.cpp's
  ``llama-vocab.cpp``);
* **SentencePiece BPE** (``"llama"``: Llama 2, TinyLlama, Mistral, Gemma, Phi-3): spaces
  written as ``▁`` (and one put before the text unless ``tokenizer.ggml.add_space_prefix``
  says not to), the two adjacent pieces whose concatenation is the best-scored piece of
  the vocabulary merged first, characters no piece spells as their UTF-8 bytes
  (``<0x0A>``): the merges are read off the scores, as Hugging Face's converter of
  SentencePiece models makes them, and the rest is that converter's layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

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
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
#: SentencePiece's space.
_SPACE = "\u2581"

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
    #: SentencePiece's: each piece's score, the unknown piece, and whether a space goes
    #: before the text.
    scores: list[float] | None = None
    unknown_token_id: int | None = None
    add_space_prefix: bool = True

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
            scores=[float(x) for x in scores]
            if (scores := md.get("tokenizer.ggml.scores")) is not None
            else None,
            unknown_token_id=opt_int("tokenizer.ggml.unknown_token_id"),
            add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True)),
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
    """A ``Tokenizer`` equivalent to the one the GGUF was converted from (byte-level or
    SentencePiece BPE; see the module docstring)."""
    if spec.model == "gpt2":
        tok = _byte_level_bpe(spec)
    elif spec.model == "llama":
        tok = _sentencepiece_bpe(spec)
    else:
        raise ValueError(
            f"GGUF tokenizer model {spec.model!r} is not supported (byte-level BPE, gpt2, "
            "and SentencePiece BPE, llama, are); use a Hugging Face model directory with "
            "a tokenizer.json instead"
        )
    if spec.token_types is not None:
        # Control tokens (<|im_start|>, ...) must match whole in text and be skippable when
        # decoding; user-defined ones match whole but are ordinary text.  An end-of-turn
        # token is a control one whatever its type says, as llama.cpp takes it (a converter
        # that found no added-token list for it wrote it as a normal piece).
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(spec.tokens, spec.token_types, strict=True)
            if kind == _CONTROL or t in END_OF_TURN_TOKENS
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(spec.tokens, spec.token_types, strict=True)
            if kind == _USER_DEFINED and t not in END_OF_TURN_TOKENS
        ]
        if control:
            tok.add_special_tokens(control)
        if user:
            tok.add_tokens(user)
    return tok


def _byte_level_bpe(spec: GGUFTokenizerSpec) -> Tokenizer:
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
    return tok


def _sentencepiece_bpe(spec: GGUFTokenizerSpec) -> Tokenizer:
    if spec.scores is None or len(spec.scores) != len(spec.tokens):
        raise ValueError("a SentencePiece GGUF tokenizer needs a score for every token")
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    unknown = spec.token(spec.unknown_token_id if spec.unknown_token_id is not None else 0)
    model = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(spec.tokens, spec.scores, spec.token_types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    replace = normalizers.Replace(" ", _SPACE)
    prefix = spec.add_space_prefix
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix else replace
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def sentencepiece_merges(
    tokens: list[str], scores: list[float], token_types: list[int] | None
) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's choice (and llama.cpp's): every split of a
    normal piece into two normal pieces, the best-scored merged piece first (ties by the
    pieces' ids)."""
    normal = {
        token: i
        for i, token in enumerate(tokens)
        if token_types is None or token_types[i] == _NORMAL
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def end_of_turn_ids(tok: Tokenizer) -> list[int]:
    """Ids of :data:`END_OF_TURN_TOKENS` that this tokenizer has as special tokens."""
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return [special[name] for name in END_OF_TURN_TOKENS if name in special]
