"""Log probabilities in OpenAI's shape: a ``logprobs.content`` entry per output token.

Each entry has the token's text, its log probability, its bytes and the most likely
alternatives (``top_logprobs``, each with text, log probability and bytes).  A token's
``bytes`` are exactly what it adds to the answer; its ``token`` text is those bytes
decoded, with U+FFFD where a token holds only part of a character (byte-level BPE splits
many characters), so joining the bytes of an answer's entries gives its text exactly
while joining their text may not.

Entries follow the text: a token's entry is released with the delta that releases its
text (:class:`~sluicegate.engine.detokenizer.TextAssembler` commits whole tokens), so a
client that reads deltas sees the entries of exactly the text it has.  An end-of-sequence
or stop token adds no text and gets no entry, as in OpenAI's answers; the token in which
a stop string begins keeps its entry.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer, decoders, pre_tokenizers

from sluicegate.scheduler.step import TokenLogprobs

#: Byte fallback tokens of SentencePiece-style vocabularies (Llama 2, Mistral).
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    assert set(table) == set(alphabet)
    return table


class TokenBytes:
    """What each token id adds to a text, as bytes (cached per id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._special = {
            token_id: added.content
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
        }
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        special = self._special.get(token_id)
        if special is not None:
            return special.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""  # past the tokenizer's vocabulary (a model's padded logit rows)
        if self._byte_level:
            table = _byte_level_table()
            return b"".join(bytes([table[ch]]) if ch in table else ch.encode() for ch in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if "▁" in piece:  # SentencePiece's word boundary is a space
            return piece.replace("▁", " ").encode()
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False)).encode()


def _top_entry(token: bytes, logprob: float) -> dict[str, Any]:
    return {
        "token": token.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(token),
    }


def logprob_entry(
    token_id: int, logprobs: TokenLogprobs, token_bytes: TokenBytes
) -> dict[str, Any]:
    """One token's ``logprobs.content`` entry."""
    entry = _top_entry(token_bytes(token_id), logprobs.logprob)
    entry["top_logprobs"] = [
        _top_entry(token_bytes(t), value)
        for t, value in zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True)
    ]
    return entry
