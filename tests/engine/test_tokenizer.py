"""The byte-level tokenizer (the sim engine's, and upstream mode's counter): what encoding
leaves behind."""

from __future__ import annotations

import ctypes
import gc

import pytest

from sluicegate.engine.tokenizer import byte_level_tokenizer


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use_bytes() -> int:
    """Bytes the C allocator has handed out and not had back (glibc's ``mallinfo2``): where
    the tokenizer's Rust side allocates, which neither weak references nor ``tracemalloc``
    see.  Not the resident size: no page the allocator keeps for later counts."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        pytest.skip("needs glibc's mallinfo2 (2.33 or later)")
    mallinfo2.restype = _MallInfo2
    gc.collect()
    return int(mallinfo2().uordblks)


def test_distinct_prompts_leave_nothing_behind() -> None:
    """Every request of a soak has a prompt of its own.  BPE's word cache, given each
    whole prompt as one word, kept each one under 256 bytes for good (~6 KB for these,
    12 MB in all): the soak's steady growth of ~3.4 KB a request (docs/benchmarks.md)."""
    tokenizer = byte_level_tokenizer()
    # 2,000 chat prompts of ~200 bytes, each its own, as the soak's requests are.
    messages = [
        [{"role": "user", "content": f"request {i}: " + "tell me more about it " * 6}]
        for i in range(2000)
    ]
    tokenizer.encode_chat(messages[0])  # whatever a first call sets up once
    before = _malloc_in_use_bytes()
    for conversation in messages[1:]:
        tokenizer.encode_chat(conversation)
    grown = _malloc_in_use_bytes() - before
    # What is left is the allocator's noise (and other threads' allocations, a few tens
    # of kilobytes here): a cache of these prompts would hold 12 MB.
    assert grown < 2_000_000, f"{grown / 1999:.0f} bytes kept per distinct prompt"
