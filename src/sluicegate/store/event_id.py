"""Stream ids and SSE event ids: ``Last-Event-ID: <stream-id>:<seq>``.

Stream ids are restricted to ``[A-Za-z0-9_.-]`` so that they embed safely in an SSE
``id:`` line, a URL and a Redis key (no ``{``/``}``, which Redis Cluster reads as a hash
tag, and no ``:``, which separates the sequence number).
"""

from __future__ import annotations

import re

MAX_STREAM_ID_LENGTH = 200
_STREAM_ID = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_STREAM_ID_LENGTH}}}")
#: ASCII digits only (``str.isdecimal`` would accept other scripts' digits), at most 18.
_SEQ = re.compile(r"[0-9]{1,18}")


def validate_stream_id(stream_id: str) -> str:
    """Return ``stream_id`` unchanged, or raise ``ValueError`` saying what is wrong."""
    if not _STREAM_ID.fullmatch(stream_id):
        raise ValueError(
            f"stream id must be 1 to {MAX_STREAM_ID_LENGTH} characters from "
            f"[A-Za-z0-9_.-]; got {stream_id[: MAX_STREAM_ID_LENGTH + 20]!r}"
        )
    return stream_id


def format_event_id(stream_id: str, seq: int) -> str:
    """The SSE ``id:`` of event ``seq`` of ``stream_id``."""
    return f"{stream_id}:{seq}"


def parse_event_id(value: str) -> tuple[str, int]:
    """Split a ``Last-Event-ID`` header into ``(stream_id, seq)``.

    Raises ``ValueError`` with a message fit for a 400 response.
    """
    stream_id, sep, seq_text = value.strip().rpartition(":")
    if not sep or not _SEQ.fullmatch(seq_text):
        raise ValueError(
            f"Last-Event-ID must look like '<stream-id>:<seq>' with a non-negative integer "
            f"seq; got {value[: MAX_STREAM_ID_LENGTH + 20]!r}"
        )
    return validate_stream_id(stream_id), int(seq_text)


def parse_after_seq(value: str) -> int:
    """Parse an ``?after=<seq>`` query parameter (a non-negative integer)."""
    text = value.strip()
    if not _SEQ.fullmatch(text):
        raise ValueError(f"after must be a non-negative integer sequence number; got {value!r}")
    return int(text)
