"""The store interface: replay logs, stream metadata, generation leases, shared buckets.

State that must outlive a process or be shared between replicas lives behind
:class:`Store`.  Two backends implement it: ``memory`` (one process) and ``redis``
(every replica sees the same logs, leases and buckets).

Replay log invariants, for every backend:

* ``append`` assigns ``seq`` 1, 2, 3, … per stream, atomically, in the store; a seq is
  never reused, even across a replica failover.
* A reader at position ``after_seq`` gets exactly the events ``after_seq + 1 …`` in order,
  or an error saying why it cannot (:class:`ReplayTrimmed`, :class:`StreamExpired`,
  :class:`StreamNotFound`): never a silent gap, never a duplicate.
* ``finish`` closes the log; ``tail`` stops after the last event of a finished stream.
* Every write refreshes the stream's time to live (``replay_ttl_seconds``).  An expired
  stream is remembered as expired for ``replay_tombstone_seconds`` more, so the API can
  tell 410 (expired) from 404 (never existed).
"""

from __future__ import annotations

import abc
import enum
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from sluicegate.store.token_bucket import Acquire
from sluicegate.types import JSONValue

logger = logging.getLogger("sluicegate.store")


# --- errors ---


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


# --- configuration ---


class StoreFailureMode(enum.StrEnum):
    """What an operation does when the backend is unreachable at run time."""

    #: Buckets admit, replay appends and metadata writes are dropped, leases are granted.
    FAIL_OPEN = "fail_open"
    #: Everything raises :class:`StoreUnavailable`.
    FAIL_CLOSED = "fail_closed"


@dataclass(slots=True, frozen=True)
class StoreConfig:
    """Limits and timings of a store; every field has a default that works."""

    #: Events kept per replay log (the oldest are trimmed).
    replay_max_events: int = 4096
    #: A stream's log and metadata are dropped this long after its last write.
    replay_ttl_seconds: float = 600.0
    #: An expired stream is reported as expired (not unknown) for this long after.
    replay_tombstone_seconds: float = 3600.0
    store_failure_mode: StoreFailureMode = StoreFailureMode.FAIL_OPEN
    #: Redis: trim logs to exactly ``replay_max_events`` (``MAXLEN``) rather than about
    #: that many (``MAXLEN ~``, cheaper, keeps up to ~100 more).
    replay_trim_exact: bool = True
    #: Redis: socket timeout of one command (a blocking tail read waits less than this).
    operation_timeout_seconds: float = 2.0
    #: Redis: connect timeout, at startup and when reconnecting.
    connect_timeout_seconds: float = 1.0
    #: Longest wait of one tail read before it re-checks the stream (bounds cancellation
    #: latency and how late an expiry is noticed).
    tail_block_seconds: float = 0.5
    #: After a failure, operations fail fast (applying the failure mode) for this long
    #: before the backend is tried again.
    retry_interval_seconds: float = 1.0
    #: Redis key prefix, so that several deployments can share one Redis.
    key_prefix: str = "sluicegate"

    def __post_init__(self) -> None:
        if self.replay_max_events < 1:
            raise ValueError(f"replay_max_events must be at least 1; got {self.replay_max_events}")
        for name in (
            "replay_ttl_seconds",
            "replay_tombstone_seconds",
            "operation_timeout_seconds",
            "connect_timeout_seconds",
            "tail_block_seconds",
        ):
            value = getattr(self, name)
            if not value > 0.0 or math.isinf(value):
                raise ValueError(f"{name} must be a positive number of seconds; got {value}")
        if not self.retry_interval_seconds >= 0.0:
            raise ValueError(
                f"retry_interval_seconds must be >= 0; got {self.retry_interval_seconds}"
            )
        if self.tail_block_seconds >= self.operation_timeout_seconds:
            raise ValueError(
                f"tail_block_seconds ({self.tail_block_seconds}) must be below "
                f"operation_timeout_seconds ({self.operation_timeout_seconds}), or every "
                "blocking tail read would time out"
            )
        if not self.key_prefix or any(c in self.key_prefix for c in "{} "):
            raise ValueError(
                f"key_prefix must be non-empty, without braces or spaces; got {self.key_prefix!r}"
            )


# --- boundary objects ---


class StreamStatus(enum.StrEnum):
    """Where a stream's generation stands."""

    #: A replica is generating it (and holds its lease).
    RUNNING = "running"
    #: Generation stopped on purpose (drain, preemption) with enough state to continue;
    #: any replica may take the lease and go on.
    CHECKPOINTED = "checkpointed"
    #: Done; its log is closed.  Set by :meth:`Store.finish` only.
    FINISHED = "finished"


@dataclass(slots=True, frozen=True)
class StreamEvent:
    """One SSE event as logged: its sequence number and its encoded bytes."""

    seq: int
    data: bytes


@dataclass(slots=True)
class StreamMeta:
    """What a replica needs to continue generating a stream it did not start.

    ``generated_token_ids`` are the tokens whose output is already in the replay log:
    :meth:`Store.append` extends them in the same atomic write as the event, so a
    replica that takes over regenerates exactly what was never logged.
    """

    tenant: str
    model: str
    prompt_token_ids: list[int]
    #: The request's seed: with ``(seed, position)`` randomness the continuation is the
    #: text the first replica would have produced.
    seed: int
    #: The rest of the sampling parameters (temperature, top_p, max_tokens, stop, …).
    sampling_params: dict[str, JSONValue] = field(default_factory=dict)
    generated_token_ids: list[int] = field(default_factory=list)
    status: StreamStatus = StreamStatus.RUNNING
    #: Whatever else the API needs to frame a continued response (endpoint, response
    #: id, created time, …).
    extra: dict[str, JSONValue] = field(default_factory=dict)
    created_at_unix_seconds: float = 0.0


@dataclass(slots=True)
class ReplayResult:
    """The events after a position, and where the stream stands."""

    stream_id: str
    after_seq: int
    #: Events in seq order.  When :attr:`trimmed`, those after :attr:`resumable_from_seq`.
    events: list[StreamEvent]
    #: Seq of the last event appended (0: none yet).
    last_seq: int
    finished: bool
    #: The smallest ``after_seq`` that can be served without a gap.
    resumable_from_seq: int

    @property
    def trimmed(self) -> bool:
        """Some events right after ``after_seq`` are gone (trimmed or never logged)."""
        return self.after_seq < self.resumable_from_seq

    @property
    def complete(self) -> bool:
        """The stream is finished and these events reach its end."""
        position = self.events[-1].seq if self.events else self.after_seq
        return self.finished and position >= self.last_seq


class SharedBucket(Protocol):
    """A token bucket that every replica sharing the store sees as one.

    Same semantics as :class:`~sluicegate.store.token_bucket.TokenBucket`
    (continuous refill, burst, debt), asynchronously.  When the store is unreachable,
    ``try_acquire``/``peek`` admit (fail_open) or raise :class:`StoreUnavailable`
    (fail_closed); ``charge``/``refund`` never raise (they run in cleanup paths; a lost
    reconciliation costs at most one request's tokens) but are counted.
    """

    @property
    def rate_per_second(self) -> float: ...

    @property
    def burst(self) -> float: ...

    async def try_acquire(self, n: float = 1.0) -> Acquire: ...

    async def charge(self, n: float) -> None: ...

    async def refund(self, n: float) -> None: ...

    async def peek(self) -> tuple[float, float]:
        """``(tokens available, seconds until full)``."""
        ...


# --- degraded-operation accounting ---


class DegradedOutcome(enum.StrEnum):
    """What an operation did instead of its work while the backend was unreachable."""

    DROPPED = "dropped"  # a write was skipped
    ADMITTED = "admitted"  # a bucket admitted without checking
    GRANTED = "granted"  # a lease was granted/renewed without checking
    RAISED = "raised"  # StoreUnavailable was raised


#: Called once per degraded operation: ``(operation, outcome)``.
DegradedCallback = Callable[[str, DegradedOutcome], None]


@dataclass(slots=True)
class StoreCounters:
    """Plain counters for metrics (e.g. ``store_degraded_operations_total{op,outcome}``)."""

    #: ``(operation, outcome) -> count`` of operations run while the backend was down.
    degraded_operations: dict[tuple[str, DegradedOutcome], int] = field(default_factory=dict)
    #: Transitions from reachable to unreachable.
    outages_total: int = 0

    def degraded_total(
        self, operation: str | None = None, outcome: DegradedOutcome | None = None
    ) -> int:
        return sum(
            count
            for (op, out), count in self.degraded_operations.items()
            if (operation is None or op == operation) and (outcome is None or out is outcome)
        )


# --- the interface ---


class Store(abc.ABC):
    """Replay logs, stream metadata, generation leases and shared buckets.

    Use as ``async with open_store(url, config) as store:`` or call :meth:`connect` at
    startup (it raises :class:`StoreUnavailable` naming the URL) and :meth:`close` at
    shutdown.  Set :attr:`on_degraded` to observe operations run while the backend is
    unreachable; :attr:`counters` counts them too.
    """

    #: Events per read while tailing.
    tail_batch_events = 256

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.counters = StoreCounters()
        self.on_degraded: DegradedCallback | None = None
        self._last_degraded_log: dict[tuple[str, DegradedOutcome], float] = {}

    # --- lifecycle ---

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """``memory`` or the backend URL without its password."""

    @property
    def available(self) -> bool:
        """Whether the last operation reached the backend (for readiness and a gauge)."""
        return True

    @abc.abstractmethod
    async def connect(self) -> None:
        """Check the backend can be reached; raise :class:`StoreUnavailable` if not."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections.  The store is unusable after."""

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- replay log ---

    @abc.abstractmethod
    async def append(
        self,
        stream_id: str,
        data: bytes,
        *,
        token_ids: Sequence[int] = (),
        owner: str | None = None,
    ) -> int | None:
        """Log one event; return its seq (1, 2, …).

        ``token_ids`` (the tokens whose output this event completes) extend
        ``StreamMeta.generated_token_ids`` in the same atomic write.  With ``owner``, the
        write is fenced: it raises :class:`LeaseLost` unless ``owner`` holds the lease.
        Raises :class:`StreamClosed` after :meth:`finish`, :class:`StreamExpired` if the
        stream expired.  Returns ``None`` only when the backend is down and the mode is
        fail_open: the event was not logged, so send it without an SSE id.
        """

    @abc.abstractmethod
    async def read(
        self, stream_id: str, after_seq: int = 0, *, limit: int | None = None
    ) -> ReplayResult:
        """The logged events after ``after_seq`` (at most ``limit``), without waiting.

        Raises :class:`StreamNotFound`/:class:`StreamExpired`, or
        :class:`InvalidReplayPosition` when ``after_seq`` is beyond the last event.  A
        trimmed position is not an error here: see :attr:`ReplayResult.trimmed`.
        """

    @abc.abstractmethod
    async def finish(self, stream_id: str, *, owner: str | None = None) -> None:
        """Close the log (status becomes FINISHED); tails stop after its last event.

        Idempotent.  Fenced by ``owner`` like :meth:`append`.
        """

    async def tail(self, stream_id: str, after_seq: int = 0) -> AsyncGenerator[StreamEvent, None]:
        """Yield the events after ``after_seq``: the missed ones, then live ones as they
        are appended, until the stream is finished.

        Raises :class:`ReplayTrimmed` rather than skip an event (at the start, or later if
        this reader falls more than ``replay_max_events`` behind), and
        :class:`StreamExpired` if the stream expires while waiting.  Cancelling the
        consuming task stops the wait within ``tail_block_seconds``.
        """
        if after_seq < 0:
            raise ValueError(f"after_seq must be >= 0; got {after_seq}")
        position = after_seq
        batch = self.tail_batch_events
        while True:
            result = await self.read(stream_id, position, limit=batch)
            if result.trimmed:
                raise ReplayTrimmed(stream_id, position, result.resumable_from_seq)
            for event in result.events:
                yield event
                position = event.seq
            if result.finished and position >= result.last_seq:
                return
            if len(result.events) < batch:
                await self._wait_for_append(stream_id, position)

    @abc.abstractmethod
    async def _wait_for_append(self, stream_id: str, after_seq: int) -> None:
        """Return when the log has an entry past ``after_seq`` (or is finished), or after
        at most ``tail_block_seconds``.  Must return at once if there already is one."""

    # --- metadata ---

    @abc.abstractmethod
    async def put_meta(self, stream_id: str, meta: StreamMeta) -> None:
        """Create or overwrite a stream's metadata (creating the stream if new).

        ``meta.status`` may not be FINISHED (use :meth:`finish`).  Raises
        :class:`StreamExpired` for a stream that expired (ids are never reused).
        """

    @abc.abstractmethod
    async def get_meta(self, stream_id: str) -> StreamMeta:
        """The stream's metadata; :class:`StreamNotFound` if none was put."""

    @abc.abstractmethod
    async def update_meta(
        self,
        stream_id: str,
        *,
        status: StreamStatus | None = None,
        extra: Mapping[str, JSONValue] | None = None,
    ) -> None:
        """Set the status (RUNNING or CHECKPOINTED) and/or replace ``extra``."""

    # --- generation lease ---

    @abc.abstractmethod
    async def acquire_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        """Take the stream's generation lease for ``ttl_seconds``.

        True if ``owner`` now holds it (taken, or already held: then renewed); False if
        another owner holds it.  A lease its owner stops renewing expires, and then
        another replica can take the stream over.
        """

    @abc.abstractmethod
    async def renew_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        """Extend ``owner``'s lease; False if it no longer holds it (stop generating)."""

    @abc.abstractmethod
    async def release_lease(self, stream_id: str, owner: str) -> bool:
        """Give the lease up; False if ``owner`` did not hold it."""

    @abc.abstractmethod
    async def lease_owner(self, stream_id: str) -> str | None:
        """Who holds the lease now (``None``: nobody; the stream can be taken over)."""

    # --- rate limits ---

    @abc.abstractmethod
    def bucket(self, key: str, rate_per_second: float, burst: float) -> SharedBucket:
        """The shared token bucket named ``key`` (e.g. ``"tenant-a:requests"``).

        Every replica asking for the same key with the same rate and burst uses one
        bucket.  Cheap: call it per request or keep the object.
        """

    # --- shared helpers ---

    def _degraded(self, operation: str, outcome: DegradedOutcome, error: object) -> None:
        """Count, log (at most once per 5 s per kind at WARNING) and report one operation
        run while the backend was unreachable."""
        key = (operation, outcome)
        counts = self.counters.degraded_operations
        counts[key] = counts.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last_degraded_log.get(key, -math.inf) >= 5.0:
            self._last_degraded_log[key] = now
            logger.warning(
                "%s %s: %s (store_failure_mode %s)",
                operation,
                outcome.value,
                error,
                self.config.store_failure_mode.value,
            )
        else:
            logger.debug("%s %s: store %s unreachable", operation, outcome.value, self.url)
        callback = self.on_degraded
        if callback is not None:
            callback(operation, outcome)


def check_after_seq(after_seq: int) -> None:
    if after_seq < 0:
        raise ValueError(f"after_seq must be >= 0; got {after_seq}")


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None; got {limit}")


def check_writable_status(status: StreamStatus) -> None:
    if status is StreamStatus.FINISHED:
        raise ValueError("status FINISHED is set by Store.finish(), which also closes the log")


def check_owner(owner: str) -> str:
    if not owner:
        raise ValueError("a lease owner must be a non-empty replica id")
    return owner


def check_ttl(ttl_seconds: float) -> int:
    """``ttl_seconds`` as whole milliseconds (at least 1)."""
    if not ttl_seconds > 0.0 or math.isinf(ttl_seconds):
        raise ValueError(f"ttl_seconds must be a positive number; got {ttl_seconds}")
    return max(1, math.ceil(ttl_seconds * 1000.0))
