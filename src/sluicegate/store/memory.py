"""The in-process store: the default for one replica, and the reference semantics.

Not thread-safe: the event loop owns it.  Expired streams are dropped lazily when
touched and by a sweep at most once per second on writes, so memory stays bounded by
``replay_max_events`` per stream and by the streams written within ``replay_ttl_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sluicegate.store.base import (
    SharedBucket,
    Store,
    check_after_seq,
    check_limit,
    check_owner,
    check_ttl,
    check_writable_status,
)
from sluicegate.store.buckets import MemoryBucket
from sluicegate.store.errors import (
    InvalidReplayPosition,
    LeaseLost,
    StreamClosed,
    StreamExpired,
    StreamNotFound,
)
from sluicegate.store.event_id import validate_stream_id
from sluicegate.store.records import (
    ReplayResult,
    StoreConfig,
    StreamEvent,
    StreamMeta,
    StreamStatus,
)
from sluicegate.types import Clock, JSONValue

_SWEEP_INTERVAL_SECONDS = 1.0


@dataclass(slots=True)
class _Stream:
    events: deque[StreamEvent]
    expires_at: float
    last_seq: int = 0
    finished: bool = False
    meta: StreamMeta | None = None
    generated_token_ids: list[int] = field(default_factory=list)
    #: Who took the generation lease last: a lease that lapsed while nobody else took it
    #: can be taken back by its owner (:meth:`MemoryStore.renew_lease`).
    taker: str | None = None
    #: Set (and replaced) on every append/finish/expiry, to wake tails.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass(slots=True)
class _Lease:
    owner: str
    expires_at: float


class MemoryStore(Store):
    """Everything in dicts of this process.  ``clock`` drives TTLs, leases and buckets."""

    def __init__(self, config: StoreConfig | None = None, *, clock: Clock = time.monotonic):
        super().__init__(config or StoreConfig())
        self._clock = clock
        self._streams: dict[str, _Stream] = {}
        #: stream id -> when to forget that it expired.
        self._tombstones: dict[str, float] = {}
        self._leases: dict[str, _Lease] = {}
        self._buckets: dict[str, MemoryBucket] = {}
        self._next_sweep_at = clock() + _SWEEP_INTERVAL_SECONDS

    @property
    def url(self) -> str:
        return "memory"

    async def connect(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to release; the data goes with the process."""

    # --- replay log ---

    async def append(
        self,
        stream_id: str,
        data: bytes,
        *,
        token_ids: Sequence[int] = (),
        owner: str | None = None,
    ) -> int | None:
        stream = self._writable(stream_id, owner)
        if stream.finished:
            raise StreamClosed(stream_id)
        stream.last_seq += 1
        stream.events.append(StreamEvent(stream.last_seq, bytes(data)))
        stream.generated_token_ids.extend(token_ids)
        stream.notify()
        return stream.last_seq

    async def read(
        self, stream_id: str, after_seq: int = 0, *, limit: int | None = None
    ) -> ReplayResult:
        check_after_seq(after_seq)
        check_limit(limit)
        stream = self._existing(stream_id)
        if after_seq > stream.last_seq:
            raise InvalidReplayPosition(stream_id, after_seq, stream.last_seq)
        events = stream.events
        first_seq = events[0].seq if events else stream.last_seq + 1
        resumable_from_seq = first_seq - 1
        start = max(after_seq, resumable_from_seq) - resumable_from_seq
        stop = None if limit is None else start + limit
        return ReplayResult(
            stream_id=stream_id,
            after_seq=after_seq,
            events=list(itertools.islice(events, start, stop)),
            last_seq=stream.last_seq,
            finished=stream.finished,
            resumable_from_seq=resumable_from_seq,
        )

    async def finish(self, stream_id: str, *, owner: str | None = None) -> None:
        stream = self._writable(stream_id, owner)
        if not stream.finished:
            stream.finished = True
            if stream.meta is not None:
                stream.meta.status = StreamStatus.FINISHED
            stream.notify()

    async def _wait_for_append(self, stream_id: str, after_seq: int) -> None:
        stream = self._existing(stream_id)
        if stream.last_seq > after_seq or stream.finished:
            return
        # Bounded so that an expiry is noticed even with no write to wake us.
        remaining = stream.expires_at - self._clock()
        timeout = min(self.config.tail_block_seconds, max(0.001, remaining))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await stream.changed.wait()

    # --- metadata ---

    async def put_meta(self, stream_id: str, meta: StreamMeta) -> None:
        check_writable_status(meta.status)
        stream = self._writable(stream_id, None)
        stored = _copy_meta(meta)
        stored.compiled_from = None  # set by update_meta only (as in Redis)
        if not stored.created_at_unix_seconds:
            stored.created_at_unix_seconds = time.time()
        stream.generated_token_ids = stored.generated_token_ids
        if stream.finished:
            stored.status = StreamStatus.FINISHED
        stream.meta = stored

    async def get_meta(self, stream_id: str) -> StreamMeta:
        stream = self._existing(stream_id)
        if stream.meta is None:
            raise _no_meta(stream_id)
        meta = _copy_meta(stream.meta)
        meta.generated_token_ids = list(stream.generated_token_ids)
        return meta

    async def update_meta(
        self,
        stream_id: str,
        *,
        status: StreamStatus | None = None,
        extra: Mapping[str, JSONValue] | None = None,
        compiled_from: int | None = None,
    ) -> None:
        if status is not None:
            check_writable_status(status)
        stream = self._existing(stream_id)
        meta = stream.meta
        if meta is None:
            raise _no_meta(stream_id)
        if status is not None and not stream.finished:
            meta.status = status
        if extra is not None:
            meta.extra = copy.deepcopy(dict(extra))
        if compiled_from is not None:
            meta.compiled_from = int(compiled_from)
        self._touch(stream)

    async def delete(self, stream_id: str) -> None:
        validate_stream_id(stream_id)
        stream = self._streams.pop(stream_id, None)
        self._leases.pop(stream_id, None)
        self._tombstones.pop(stream_id, None)
        if stream is not None:
            stream.notify()

    # --- generation lease ---

    async def acquire_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        check_owner(owner)
        ttl_ms = check_ttl(ttl_seconds)
        holder = self._live_lease(stream_id)
        if holder is not None and holder.owner != owner:
            return False
        self._leases[stream_id] = _Lease(owner, self._clock() + ttl_ms / 1000.0)
        if (stream := self._streams.get(stream_id)) is not None:
            stream.taker = owner
        return True

    async def renew_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        ttl_ms = check_ttl(ttl_seconds)
        holder = self._live_lease(stream_id)
        if holder is None:
            stream = self._streams.get(stream_id)
            if stream is None or stream.finished or stream.taker != owner:
                return False
            holder = self._leases[stream_id] = _Lease(owner, 0.0)  # lapsed: taken back
        elif holder.owner != owner:
            return False
        holder.expires_at = self._clock() + ttl_ms / 1000.0
        return True

    async def release_lease(self, stream_id: str, owner: str) -> bool:
        holder = self._live_lease(stream_id)
        if holder is None or holder.owner != owner:
            return False
        del self._leases[stream_id]
        return True

    async def lease_owner(self, stream_id: str) -> str | None:
        holder = self._live_lease(stream_id)
        return None if holder is None else holder.owner

    # --- rate limits ---

    def bucket(self, key: str, rate_per_second: float, burst: float) -> SharedBucket:
        bucket = self._buckets.get(key)
        if bucket is None or (bucket.rate_per_second, bucket.burst) != (
            float(rate_per_second),
            float(burst),
        ):
            bucket = self._buckets[key] = MemoryBucket(rate_per_second, burst, self._clock)
        return bucket

    # --- internals ---

    def _existing(self, stream_id: str) -> _Stream:
        """The live stream, or StreamExpired/StreamNotFound."""
        validate_stream_id(stream_id)
        stream = self._streams.get(stream_id)
        now = self._clock()
        if stream is not None and stream.expires_at <= now:
            self._expire(stream_id, stream)
            stream = None
        if stream is None:
            if self._tombstones.get(stream_id, -1.0) > now:
                raise StreamExpired(stream_id)
            raise StreamNotFound(stream_id)
        return stream

    def _writable(self, stream_id: str, owner: str | None) -> _Stream:
        """The stream to write to (created if new), its TTL refreshed; fenced by owner."""
        if owner is not None:
            holder = self._live_lease(stream_id)
            if holder is None or holder.owner != owner:
                raise LeaseLost(stream_id, owner)
        try:
            stream = self._existing(stream_id)
        except StreamExpired:
            raise
        except StreamNotFound:
            stream = self._streams[stream_id] = _Stream(
                deque(maxlen=self.config.replay_max_events), expires_at=0.0
            )
        self._touch(stream)
        self._maybe_sweep()
        return stream

    def _touch(self, stream: _Stream) -> None:
        stream.expires_at = self._clock() + self.config.replay_ttl_seconds

    def _expire(self, stream_id: str, stream: _Stream) -> None:
        del self._streams[stream_id]
        self._tombstones[stream_id] = stream.expires_at + self.config.replay_tombstone_seconds
        stream.notify()

    def _live_lease(self, stream_id: str) -> _Lease | None:
        validate_stream_id(stream_id)
        holder = self._leases.get(stream_id)
        if holder is not None and holder.expires_at <= self._clock():
            del self._leases[stream_id]
            return None
        return holder

    def _maybe_sweep(self) -> None:
        now = self._clock()
        if now < self._next_sweep_at:
            return
        self._next_sweep_at = now + _SWEEP_INTERVAL_SECONDS
        for stream_id, stream in [(k, s) for k, s in self._streams.items() if s.expires_at <= now]:
            self._expire(stream_id, stream)
        for stream_id in [k for k, until in self._tombstones.items() if until <= now]:
            del self._tombstones[stream_id]
        for stream_id in [k for k, lease in self._leases.items() if lease.expires_at <= now]:
            del self._leases[stream_id]


def _copy_meta(meta: StreamMeta) -> StreamMeta:
    """A copy that shares no mutable list or dict with the caller's object."""
    return StreamMeta(
        tenant=meta.tenant,
        model=meta.model,
        prompt_token_ids=list(meta.prompt_token_ids),
        seed=meta.seed,
        sampling_params=copy.deepcopy(meta.sampling_params),
        generated_token_ids=list(meta.generated_token_ids),
        status=meta.status,
        extra=copy.deepcopy(meta.extra),
        created_at_unix_seconds=meta.created_at_unix_seconds,
        resume_token_sha256=meta.resume_token_sha256,
        compiled_from=meta.compiled_from,
    )


def _no_meta(stream_id: str) -> StreamNotFound:
    return StreamNotFound(
        stream_id, f"stream {stream_id!r} has a replay log but no metadata to continue it from"
    )
