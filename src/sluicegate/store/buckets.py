"""Shared token buckets: in this process, or one Lua script in Redis for every replica.

Both follow :class:`~sluicegate.store.token_bucket.TokenBucket` exactly: continuous
refill at ``rate_per_second`` up to ``burst``, all-or-nothing ``try_acquire(n)`` with the
exact ``retry_after_seconds``, ``charge`` (may go into debt) and ``refund`` (capped at the
burst), and the same 1e-9·burst float tolerance.  The Redis bucket reads the clock of
the Redis server (``TIME`` inside the script), so replicas whose clocks disagree still
share one bucket, and keeps its state in one hash that expires a minute after the bucket
would be full again (a missing hash *is* a full bucket).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from sluicegate.store.errors import StoreUnavailable
from sluicegate.store.records import DegradedOutcome, StoreFailureMode
from sluicegate.store.token_bucket import Acquire, TokenBucket
from sluicegate.types import Clock

if TYPE_CHECKING:  # the redis client loads only for a Redis store (a faster start-up)
    from redis.commands.core import AsyncScript

    from sluicegate.store.redis_connection import RedisConnection


def check_bucket_params(rate_per_second: float, burst: float) -> None:
    if not rate_per_second > 0.0 or math.isinf(rate_per_second):
        raise ValueError(f"rate_per_second must be a positive number; got {rate_per_second}")
    if not burst > 0.0 or math.isinf(burst):
        raise ValueError(f"burst must be a positive number; got {burst}")


class MemoryBucket:
    """A :class:`TokenBucket` behind the async :class:`~sluicegate.store.base.SharedBucket`
    interface (one process only)."""

    __slots__ = ("_bucket",)

    def __init__(self, rate_per_second: float, burst: float, clock: Clock) -> None:
        self._bucket = TokenBucket(rate_per_second, burst, clock)

    @property
    def rate_per_second(self) -> float:
        return self._bucket.rate_per_second

    @property
    def burst(self) -> float:
        return self._bucket.burst

    async def try_acquire(self, n: float = 1.0) -> Acquire:
        return self._bucket.try_acquire(n)

    async def charge(self, n: float) -> None:
        self._bucket.charge(n)

    async def refund(self, n: float) -> None:
        self._bucket.refund(n)

    async def peek(self) -> tuple[float, float]:
        return self._bucket.peek()


#: KEYS[1]: the bucket's hash.  ARGV: op (acquire|charge|refund|peek), rate_per_second,
#: burst, n, now in seconds ('' = the Redis server's TIME).
#: Returns {admitted, exceeds_burst, tokens, retry_after_seconds, reset_seconds}, floats as
#: '%.17g' strings (a Lua number reply would be truncated to an integer).
BUCKET_LUA = """
local op = ARGV[1]
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local now
if ARGV[5] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[5])
end
local eps = 1e-9 * math.max(1.0, burst)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated_at')
local tokens = tonumber(state[1])
local updated_at = tonumber(state[2])
if tokens == nil or updated_at == nil then
  tokens = burst
  updated_at = now
end
local elapsed = now - updated_at
if elapsed > 0 then
  tokens = math.min(burst, tokens + elapsed * rate)
  updated_at = now
end
local admitted = 0
local exceeds = 0
local retry_after = 0
if op == 'acquire' then
  if n > burst + eps then
    exceeds = 1
  elseif tokens + eps >= n then
    tokens = tokens - n
    if -eps < tokens and tokens < eps then tokens = 0 end
    admitted = 1
  else
    retry_after = (n - tokens) / rate
  end
elseif op == 'charge' then
  tokens = tokens - n
elseif op == 'refund' then
  tokens = math.min(burst, tokens + n)
end
local reset = 0
if burst - tokens > eps then reset = (burst - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens),
           'updated_at', string.format('%.17g', updated_at))
local ttl_ms = math.ceil((math.min(reset, 31536000) + 60) * 1000)
redis.call('PEXPIRE', KEYS[1], string.format('%d', ttl_ms))
return {admitted, exceeds, string.format('%.17g', tokens),
        string.format('%.17g', retry_after), string.format('%.17g', reset)}
"""

#: ``(operation, outcome, error)``: the owning store's degraded-operation hook.
DegradedHook = Callable[[str, DegradedOutcome, object], None]


class RedisBucket:
    """One bucket whose state lives in Redis; every call is one atomic script run.

    ``clock`` overrides the Redis server's clock (tests only: it makes the bucket
    deterministic); ``None`` uses the server's ``TIME``.
    """

    __slots__ = (
        "_burst",
        "_clock",
        "_connection",
        "_degraded",
        "_failure_mode",
        "_key",
        "_rate",
        "_script",
    )

    def __init__(
        self,
        connection: RedisConnection,
        script: AsyncScript,
        redis_key: str,
        rate_per_second: float,
        burst: float,
        *,
        failure_mode: StoreFailureMode,
        degraded: DegradedHook,
        clock: Clock | None = None,
    ) -> None:
        check_bucket_params(rate_per_second, burst)
        self._connection = connection
        self._script = script
        self._key = redis_key
        self._rate = float(rate_per_second)
        self._burst = float(burst)
        self._failure_mode = failure_mode
        self._degraded = degraded
        self._clock = clock

    @property
    def rate_per_second(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    async def try_acquire(self, n: float = 1.0) -> Acquire:
        try:
            reply = await self._call("bucket_acquire", "acquire", n)
        except StoreUnavailable as error:
            if self._failure_mode is StoreFailureMode.FAIL_CLOSED:
                self._degraded("bucket_acquire", DegradedOutcome.RAISED, error)
                raise
            if n > self._burst + 1e-9 * max(1.0, self._burst):
                return Acquire(False, self._burst, math.inf, 0.0, exceeds_burst=True)
            self._degraded("bucket_acquire", DegradedOutcome.ADMITTED, error)
            return Acquire(True, self._burst, 0.0, 0.0)
        admitted, exceeds, tokens, retry_after, reset = reply
        if exceeds:
            return Acquire(False, tokens, math.inf, reset, exceeds_burst=True)
        return Acquire(bool(admitted), tokens, retry_after, reset)

    async def charge(self, n: float) -> None:
        await self._reconcile("bucket_charge", "charge", n)

    async def refund(self, n: float) -> None:
        await self._reconcile("bucket_refund", "refund", n)

    async def peek(self) -> tuple[float, float]:
        try:
            _, _, tokens, _, reset = await self._call("bucket_peek", "peek", 0.0)
        except StoreUnavailable as error:
            if self._failure_mode is StoreFailureMode.FAIL_CLOSED:
                self._degraded("bucket_peek", DegradedOutcome.RAISED, error)
                raise
            self._degraded("bucket_peek", DegradedOutcome.ADMITTED, error)
            return self._burst, 0.0
        return tokens, reset

    async def _reconcile(self, operation: str, op: str, n: float) -> None:
        try:
            await self._call(operation, op, n)
        except StoreUnavailable as error:
            self._degraded(operation, DegradedOutcome.DROPPED, error)

    async def _call(
        self, operation: str, op: str, n: float
    ) -> tuple[int, int, float, float, float]:
        now = "" if self._clock is None else repr(float(self._clock()))
        args = (op, repr(self._rate), repr(self._burst), repr(float(n)), now)
        # Not idempotent (a retried acquire could take twice): never retried.
        reply = await self._connection.run(
            operation,
            lambda client: self._script(keys=[self._key], args=args, client=client),
            idempotent=op == "peek",
        )
        admitted, exceeds, tokens, retry_after, reset = reply
        return int(admitted), int(exceeds), float(tokens), float(retry_after), float(reset)
