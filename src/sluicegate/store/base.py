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
import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import Protocol

from sluicegate.store.errors import ReplayTrimmed, StoreUnavailable
from sluicegate.store.records import (
    DegradedCallback,
    DegradedOutcome,
    ReplayResult,
    StoreConfig,
    StoreCounters,
    StoreFailureMode,
    StreamEvent,
    StreamMeta,
    StreamStatus,
)
from sluicegate.store.token_bucket import Acquire
from sluicegate.types import JSONValue

logger = logging.getLogger("sluicegate.store")


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

    async def ping(self) -> bool:
        """Ask the backend whether it is up (updates :attr:`available`); never raises."""
        return True

    def require_available(self) -> None:
        """Raise :class:`StoreUnavailable` if the backend is down and the failure mode is
        fail_closed: then no request may start (its limits and its stream log need the
        store), streamed or not."""
        if self.config.store_failure_mode is StoreFailureMode.FAIL_CLOSED and not self.available:
            raise StoreUnavailable(f"the store at {self.url} is unreachable", operation="admit")

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
        compiled_from: int | None = None,
    ) -> None:
        """Set the status (RUNNING or CHECKPOINTED), replace ``extra`` and/or set
        ``compiled_from`` (each left as it is when None)."""

    @abc.abstractmethod
    async def delete(self, stream_id: str) -> None:
        """Drop the stream whole (log, metadata, lease): it is unknown from now on (a
        stored response deleted by its owner).  Idempotent."""

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
        """Extend ``owner``'s lease; False if another owner took it (stop generating).

        A lease that lapsed while nobody else took the stream (its owner stalled past the
        TTL: a busy machine, a long pause of the process) is taken back, unless the
        stream is finished: the owner is still the last to have taken it, so no other
        replica wrote to it since.  A fenced write that raised :class:`LeaseLost` may
        renew and try once more.
        """

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
