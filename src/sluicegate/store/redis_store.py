"""The Redis store: every replica sees the same replay logs, leases and buckets.

Replay logs are Redis Streams (``XADD … MAXLEN``, ``XREAD BLOCK`` for the live tail),
metadata a hash, the generation lease a ``SET NX PX`` key, buckets a Lua script; every
multi-key operation is one Lua script (see :mod:`sluicegate.store.redis_scripts`), so a
replica dying half-way never leaves a log and its metadata disagreeing.

When Redis is unreachable each operation applies ``store_failure_mode`` (see
:class:`~sluicegate.store.base.StoreFailureMode`), logs and counts, and never crashes
the caller with anything but :class:`~sluicegate.store.base.StoreUnavailable`.  An
append dropped while Redis was down leaves a hole that the log cannot replay, so the
next append (or finish) of that stream that gets through records a *gap floor*:
readers positioned before it get :class:`~sluicegate.store.base.ReplayTrimmed`, never a
silent gap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis

import sluicegate.store.redis_scripts as lua
from sluicegate.store.base import (
    SharedBucket,
    Store,
    check_after_seq,
    check_limit,
    check_owner,
    check_ttl,
    check_writable_status,
)
from sluicegate.store.buckets import BUCKET_LUA, RedisBucket, check_bucket_params
from sluicegate.store.errors import (
    InvalidReplayPosition,
    LeaseLost,
    StoreError,
    StoreUnavailable,
    StreamClosed,
    StreamExpired,
    StreamNotFound,
)
from sluicegate.store.event_id import validate_stream_id
from sluicegate.store.records import (
    DegradedOutcome,
    ReplayResult,
    StoreConfig,
    StoreFailureMode,
    StreamEvent,
    StreamMeta,
    StreamStatus,
)
from sluicegate.store.redis_connection import RedisConnection
from sluicegate.types import Clock, JSONValue

T = TypeVar("T")

#: Streams whose appends were dropped, remembered until their next write gets through.
_MAX_GAPPED_STREAMS = 65536


class RedisStore(Store):
    """A :class:`Store` in Redis at ``url`` (``redis://HOST:PORT/DB``).

    ``bucket_clock`` replaces the Redis server's clock in bucket scripts: for tests
    only; leave it ``None`` so that every replica shares the server's clock.
    """

    def __init__(
        self, url: str, config: StoreConfig | None = None, *, bucket_clock: Clock | None = None
    ) -> None:
        super().__init__(config or StoreConfig())
        self._connection = RedisConnection(url, self.config, self.counters)
        client = self._connection.client
        self._append = client.register_script(lua.APPEND_LUA)
        self._finish = client.register_script(lua.FINISH_LUA)
        self._put_meta = client.register_script(lua.PUT_META_LUA)
        self._update_meta = client.register_script(lua.UPDATE_META_LUA)
        self._get_meta = client.register_script(lua.GET_META_LUA)
        self._read = client.register_script(lua.READ_LUA)
        self._acquire_lease = client.register_script(lua.ACQUIRE_LEASE_LUA)
        self._renew_lease = client.register_script(lua.RENEW_LEASE_LUA)
        self._release_lease = client.register_script(lua.RELEASE_LEASE_LUA)
        self._bucket_script = client.register_script(BUCKET_LUA)
        self._bucket_clock = bucket_clock
        self._ttl_ms = check_ttl(self.config.replay_ttl_seconds)
        self._known_ttl_ms = check_ttl(
            self.config.replay_ttl_seconds + self.config.replay_tombstone_seconds
        )
        self._gapped: dict[str, None] = {}

    @property
    def url(self) -> str:
        return self._connection.url

    @property
    def available(self) -> bool:
        return self._connection.available

    async def ping(self) -> bool:
        async def ping(client: aioredis.Redis) -> None:
            await client.ping()

        try:
            await self._connection.run("ping", ping, idempotent=True)
        except StoreUnavailable:
            return False
        return True

    async def connect(self) -> None:
        await self._connection.connect()
        # Load the scripts now so that the first EVALSHA finds them (AsyncScript falls
        # back to EVAL by itself if Redis restarted and forgot them).
        scripts = (
            self._append,
            self._finish,
            self._put_meta,
            self._update_meta,
            self._get_meta,
            self._read,
            self._acquire_lease,
            self._renew_lease,
            self._release_lease,
            self._bucket_script,
        )

        async def load(client: aioredis.Redis) -> None:
            for script in scripts:
                await client.script_load(script.script)

        await self._connection.run("connect", load, idempotent=True)

    async def close(self) -> None:
        await self._connection.close()

    # --- keys ---

    def _keys(self, stream_id: str) -> list[str]:
        """state, log, tokens, known, lease (see :mod:`~sluicegate.store.redis_scripts`)."""
        base = f"{self.config.key_prefix}:stream:{{{validate_stream_id(stream_id)}}}"
        return [f"{base}:state", f"{base}:log", f"{base}:tokens", f"{base}:known", f"{base}:lease"]

    def _write_args(self, owner: str | None) -> list[str | int | bytes]:
        return [self._ttl_ms, self._known_ttl_ms, owner or ""]

    # --- replay log ---

    async def append(
        self,
        stream_id: str,
        data: bytes,
        *,
        token_ids: Sequence[int] = (),
        owner: str | None = None,
    ) -> int | None:
        keys = self._keys(stream_id)
        gap = stream_id in self._gapped
        args = [
            *self._write_args(owner),
            bytes(data),
            self.config.replay_max_events,
            "1" if self.config.replay_trim_exact else "0",
            "1" if gap else "0",
            *(int(t) for t in token_ids),
        ]
        try:
            reply = await self._connection.run(
                "append", lambda c: self._append(keys=keys, args=args, client=c), idempotent=False
            )
        except StoreUnavailable as error:
            # Whether or not the script ran, readers must not resume across this event.
            self._remember_gap(stream_id)
            if self.config.store_failure_mode is StoreFailureMode.FAIL_CLOSED:
                self._degraded("append", DegradedOutcome.RAISED, error)
                raise
            self._degraded("append", DegradedOutcome.DROPPED, error)
            return None
        code, seq = int(reply[0]), int(reply[1])
        self._raise_for(code, stream_id, owner)
        if gap:
            self._gapped.pop(stream_id, None)
        return seq

    async def read(
        self, stream_id: str, after_seq: int = 0, *, limit: int | None = None
    ) -> ReplayResult:
        check_after_seq(after_seq)
        check_limit(limit)
        keys = self._keys(stream_id)
        read_keys = [keys[0], keys[1], keys[3]]
        args = [after_seq, limit or 0]
        reply = await self._must("read", lambda c: self._read(keys=read_keys, args=args, client=c))
        code = int(reply[0])
        if code == lua.CODE_BAD_POSITION:
            raise InvalidReplayPosition(stream_id, after_seq, int(reply[1]))
        self._raise_for(code, stream_id, None)
        events = []
        for entry_id, fields in reply[4]:
            seq_text, _, sub = bytes(entry_id).partition(b"-")
            if sub == b"0":
                events.append(StreamEvent(int(seq_text), bytes(fields[1])))
        return ReplayResult(
            stream_id=stream_id,
            after_seq=after_seq,
            events=events,
            last_seq=int(reply[1]),
            finished=bool(int(reply[2])),
            resumable_from_seq=int(reply[3]),
        )

    async def finish(self, stream_id: str, *, owner: str | None = None) -> None:
        keys = self._keys(stream_id)
        gap = stream_id in self._gapped
        args = [*self._write_args(owner), "1" if gap else "0"]
        try:
            reply = await self._connection.run(
                "finish", lambda c: self._finish(keys=keys, args=args, client=c), idempotent=True
            )
        except StoreUnavailable as error:
            self._degraded_write("finish", error)
            return
        self._raise_for(int(reply[0]), stream_id, owner)
        self._gapped.pop(stream_id, None)

    async def _wait_for_append(self, stream_id: str, after_seq: int) -> None:
        log_key = self._keys(stream_id)[1]
        block_ms = max(1, math.ceil(self.config.tail_block_seconds * 1000.0))
        # XREAD returns at once if an entry past after_seq (an event or the end marker)
        # is already there; otherwise it blocks at most block_ms.
        await self._must(
            "tail",
            lambda c: c.xread({log_key: f"{after_seq}-0"}, count=1, block=block_ms),
        )

    # --- metadata ---

    async def put_meta(self, stream_id: str, meta: StreamMeta) -> None:
        check_writable_status(meta.status)
        keys = self._keys(stream_id)
        fixed = {
            "tenant": meta.tenant,
            "model": meta.model,
            "prompt_token_ids": meta.prompt_token_ids,
            "seed": meta.seed,
            "sampling_params": meta.sampling_params,
            "created_at_unix_seconds": meta.created_at_unix_seconds or time.time(),
            "resume_token_sha256": meta.resume_token_sha256,
        }
        args = [
            *self._write_args(None),
            orjson.dumps(fixed),
            meta.status.value,
            orjson.dumps(meta.extra),
            *(int(t) for t in meta.generated_token_ids),
        ]
        try:
            reply = await self._connection.run(
                "put_meta",
                lambda c: self._put_meta(keys=keys, args=args, client=c),
                idempotent=True,
            )
        except StoreUnavailable as error:
            self._degraded_write("put_meta", error)
            return
        self._raise_for(int(reply[0]), stream_id, None)

    async def get_meta(self, stream_id: str) -> StreamMeta:
        keys = self._keys(stream_id)
        meta_keys = [keys[0], keys[2], keys[3]]
        reply = await self._must(
            "get_meta", lambda c: self._get_meta(keys=meta_keys, args=[], client=c)
        )
        self._raise_for(int(reply[0]), stream_id, None)
        fixed: dict[str, Any] = orjson.loads(reply[1])
        extra: dict[str, JSONValue] = orjson.loads(reply[3]) if reply[3] else {}
        return StreamMeta(
            tenant=fixed["tenant"],
            model=fixed["model"],
            prompt_token_ids=fixed["prompt_token_ids"],
            seed=fixed["seed"],
            sampling_params=fixed["sampling_params"],
            generated_token_ids=[int(t) for t in reply[4]],
            status=StreamStatus(bytes(reply[2]).decode()),
            extra=extra,
            created_at_unix_seconds=fixed["created_at_unix_seconds"],
            resume_token_sha256=str(fixed.get("resume_token_sha256") or ""),
            compiled_from=int(reply[5]) if len(reply) > 5 and reply[5] else None,
        )

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
        keys = self._keys(stream_id)
        args = [
            *self._write_args(None),
            "" if status is None else status.value,
            b"" if extra is None else orjson.dumps(dict(extra)),
            "" if compiled_from is None else int(compiled_from),
        ]
        try:
            reply = await self._connection.run(
                "update_meta",
                lambda c: self._update_meta(keys=keys, args=args, client=c),
                idempotent=True,
            )
        except StoreUnavailable as error:
            self._degraded_write("update_meta", error)
            return
        self._raise_for(int(reply[0]), stream_id, None)

    async def delete(self, stream_id: str) -> None:
        keys = self._keys(stream_id)
        await self._must("delete", lambda c: c.delete(*keys))

    # --- generation lease ---

    async def acquire_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        return await self._lease_call(
            "acquire_lease",
            self._acquire_lease,
            stream_id,
            [check_owner(owner), check_ttl(ttl_seconds)],
        )

    async def renew_lease(self, stream_id: str, owner: str, ttl_seconds: float) -> bool:
        return await self._lease_call(
            "renew_lease", self._renew_lease, stream_id, [owner, check_ttl(ttl_seconds)]
        )

    async def release_lease(self, stream_id: str, owner: str) -> bool:
        lease_key = self._keys(stream_id)[4]
        try:
            reply = await self._connection.run(
                "release_lease",
                lambda c: self._release_lease(keys=[lease_key], args=[owner], client=c),
                idempotent=True,
            )
        except StoreUnavailable as error:
            # Never raises: it runs in cleanup, and the lease expires by itself anyway.
            self._degraded("release_lease", DegradedOutcome.DROPPED, error)
            return False
        return bool(int(reply))

    async def lease_owner(self, stream_id: str) -> str | None:
        lease_key = self._keys(stream_id)[4]
        owner = await self._must("lease_owner", lambda c: c.get(lease_key))
        if owner is None:
            return None
        return owner.decode() if isinstance(owner, bytes) else str(owner)

    async def _lease_call(
        self, operation: str, script: Any, stream_id: str, args: list[str | int]
    ) -> bool:
        keys = self._keys(stream_id)
        lease_and_state = [keys[4], keys[0]]
        try:
            reply = await self._connection.run(
                operation,
                lambda c: script(keys=lease_and_state, args=args, client=c),
                idempotent=True,
            )
        except StoreUnavailable as error:
            if self.config.store_failure_mode is StoreFailureMode.FAIL_CLOSED:
                self._degraded(operation, DegradedOutcome.RAISED, error)
                raise
            self._degraded(operation, DegradedOutcome.GRANTED, error)
            return True
        return bool(int(reply))

    # --- rate limits ---

    def bucket(self, key: str, rate_per_second: float, burst: float) -> SharedBucket:
        check_bucket_params(rate_per_second, burst)
        return RedisBucket(
            self._connection,
            self._bucket_script,
            f"{self.config.key_prefix}:bucket:{key}",
            rate_per_second,
            burst,
            failure_mode=self.config.store_failure_mode,
            degraded=self._degraded,
            clock=self._bucket_clock,
        )

    # --- internals ---

    async def _must(self, operation: str, call: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """A read: there is nothing to fall back to, so it raises in either mode."""
        try:
            return await self._connection.run(operation, call, idempotent=True)
        except StoreUnavailable as error:
            self._degraded(operation, DegradedOutcome.RAISED, error)
            raise

    def _degraded_write(self, operation: str, error: StoreUnavailable) -> None:
        if self.config.store_failure_mode is StoreFailureMode.FAIL_CLOSED:
            self._degraded(operation, DegradedOutcome.RAISED, error)
            raise error
        self._degraded(operation, DegradedOutcome.DROPPED, error)

    def _remember_gap(self, stream_id: str) -> None:
        gapped = self._gapped
        gapped[stream_id] = None
        if len(gapped) > _MAX_GAPPED_STREAMS:
            del gapped[next(iter(gapped))]

    @staticmethod
    def _raise_for(code: int, stream_id: str, owner: str | None) -> None:
        if code >= lua.CODE_NOOP:
            return
        if code == lua.CODE_NOT_FOUND:
            raise StreamNotFound(stream_id)
        if code == lua.CODE_EXPIRED:
            raise StreamExpired(stream_id)
        if code == lua.CODE_LEASE_LOST:
            raise LeaseLost(stream_id, owner or "")
        if code == lua.CODE_CLOSED:
            raise StreamClosed(stream_id)
        if code == lua.CODE_NO_META:
            raise StreamNotFound(
                stream_id,
                f"stream {stream_id!r} has a replay log but no metadata to continue it from",
            )
        raise StoreError(f"unexpected reply {code} from the Redis store for {stream_id!r}")
