"""What the sim engine must answer: its text is a pure function of (seed, prompt)."""

from __future__ import annotations

import hashlib

from sluicegate.engine.sim import sim_text_bytes
from sluicegate.engine.tokenizer import byte_level_tokenizer

TOKENIZER = byte_level_tokenizer()


def expected_text(prompt_ids: list[int], seed: int, num_tokens: int) -> str:
    digest = hashlib.blake2b(repr(prompt_ids).encode(), digest_size=16).digest()
    # A character cut by max_tokens is never emitted half-way.
    return sim_text_bytes(seed, digest, num_tokens).decode("utf-8", errors="ignore")


def expected_chat(messages: list[dict[str, str]], seed: int, num_tokens: int) -> str:
    return expected_text(TOKENIZER.encode_chat(messages), seed, num_tokens)


def expected_completion(prompt: str, seed: int, num_tokens: int) -> str:
    return expected_text(TOKENIZER.encode(prompt), seed, num_tokens)
