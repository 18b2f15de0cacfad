"""Errors the store raises on purpose, each saying what a caller can do about it."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class StoreUnavailable(StoreError):
    """The backend could not be reached (or answered too late) for ``operation``."""

    def __init__(self, message: str, *, operation: str = "connect") -> None:
        super().__init__(message)
        self.operation = operation


class StreamNotFound(StoreError, LookupError):
    """No such stream: it never existed here (404)."""

    def __init__(self, stream_id: str, message: str | None = None) -> None:
        super().__init__(message or f"stream {stream_id!r} does not exist")
        self.stream_id = stream_id


class StreamExpired(StreamNotFound):
    """The stream existed but its replay log expired (410)."""

    def __init__(self, stream_id: str, message: str | None = None) -> None:
        super().__init__(
            stream_id,
            message
            or f"stream {stream_id!r} has expired: its replay log was dropped after "
            "replay_ttl_seconds without writes",
        )


class ReplayTrimmed(StoreError):
    """Events after ``after_seq`` are no longer all in the log.

    ``resumable_from_seq`` is the smallest position a reader can resume from without a
    gap: it has to have seen that event already.
    """

    def __init__(self, stream_id: str, after_seq: int, resumable_from_seq: int) -> None:
        super().__init__(
            f"stream {stream_id!r}: the events after seq {after_seq} are no longer all in "
            f"the replay log (it keeps the last replay_max_events events, and events lost "
            f"while the store was down cannot be replayed); the earliest position that can "
            f"be resumed without a gap is after seq {resumable_from_seq}"
        )
        self.stream_id = stream_id
        self.after_seq = after_seq
        self.resumable_from_seq = resumable_from_seq


class InvalidReplayPosition(StoreError, ValueError):
    """A position the stream never reached (``after_seq`` beyond its last event)."""

    def __init__(self, stream_id: str, after_seq: int, last_seq: int) -> None:
        super().__init__(
            f"stream {stream_id!r} has no event {after_seq}: its last event is seq "
            f"{last_seq}; resume from a position you received"
        )
        self.stream_id = stream_id
        self.after_seq = after_seq
        self.last_seq = last_seq


class StreamClosed(StoreError):
    """An append to a stream that :meth:`Store.finish` already closed."""

    def __init__(self, stream_id: str) -> None:
        super().__init__(f"stream {stream_id!r} is finished; nothing can be appended to it")
        self.stream_id = stream_id


class LeaseLost(StoreError):
    """A write fenced by a lease that ``owner`` no longer holds (another replica took over)."""

    def __init__(self, stream_id: str, owner: str) -> None:
        super().__init__(
            f"replica {owner!r} no longer holds the generation lease of stream {stream_id!r}; "
            "stop generating it"
        )
        self.stream_id = stream_id
        self.owner = owner
