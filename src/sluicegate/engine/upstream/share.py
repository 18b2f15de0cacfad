"""Gateway replicas in front of one pool: what each holds at each upstream, exchanged
through the shared store's Redis, so that together they hold no more than an upstream's
limit.

A gateway alone holds up to an upstream's limit of requests at once.  Two gateways in
front of the same upstream, each alone in its view, would hold twice that: the upstream
would queue the excess inside itself, where no gateway sees it, and every promise made
for it would break.  So each replica publishes, per upstream, how many requests it holds
(a hash per upstream, one field per replica: the count and when it was written), and
reads the others'.  An upstream has room for a replica while its own requests and the
others' are below the limit; its seats for admission are the limit less the others'; the
limit learned from the upstream's own line (``waiting_inside``) is measured against
everything held there.  Taking a place is one atomic script (:meth:`HeldElsewhere.claim`:
everyone's count checked against the limit and this replica's raised in one step), so
two replicas never both take the last place: a place one lets go of is offered to both
by their next exchange, and the first to claim it has it.  A replica publishes when it
lets go of a request and at least every ``interval_seconds`` (the write and the read in
one pipeline); an entry older than ``stale_seconds`` is a replica gone and counts for
nothing.  Redis unreachable: each replica counts alone (as without a shared store) and
says so once in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
import redis.exceptions

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Elsewhere:
    """What the other live replicas hold at one upstream, and how many they are."""

    held: int = 0
    replicas: int = 0


#: The hash of an upstream (its configured name): replica -> "count wall-time".
KEY = "sluicegate:upstream-held:{name}"

#: Take a place, atomically: KEYS[1] the upstream's hash; ARGV the replica, what it will
#: hold with the new request, the limit, the time, the staleness.  Writes the new count
#: and returns what the others hold if everyone's stays within the limit, else writes
#: nothing and returns -1 - what the others hold.
_CLAIM = """
local entries = redis.call('HGETALL', KEYS[1])
local now, stale = tonumber(ARGV[4]), tonumber(ARGV[5])
local others = 0
for i = 1, #entries, 2 do
  if entries[i] ~= ARGV[1] then
    local count, written = string.match(entries[i + 1], '^(%d+) ([%d.]+)$')
    if count and now - tonumber(written) <= stale then others = others + tonumber(count) end
  end
end
if others + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return -1 - others end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[6])
return others
"""


class HeldElsewhere:
    """This replica's side of the exchange."""

    def __init__(self, url: str, interval_seconds: float, replica: str | None = None) -> None:
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self.interval_seconds = interval_seconds
        #: An entry unwritten for this long is a replica gone.
        self.stale_seconds = max(3.0, 10 * interval_seconds)
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.failing = False
        self._ttl = max(60, int(4 * self.stale_seconds))
        self._claim = self.client.register_script(_CLAIM)

    async def exchange(self, held: dict[str, int]) -> dict[str, Elsewhere] | None:
        """Publish what this replica holds at each upstream; return what the other live
        replicas hold there (None: Redis did not answer)."""
        now = time.time()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name, count in held.items():
                    key = KEY.format(name=name)
                    pipe.hset(key, self.replica, f"{count} {now:.3f}")
                    pipe.expire(key, self._ttl)
                    pipe.hgetall(key)
                replies = await pipe.execute()
        except (redis.exceptions.RedisError, OSError) as exc:
            if not self.failing:
                log.warning("upstream load not shared with other replicas: %s", exc)
            self.failing = True
            return None
        if self.failing:
            log.info("upstream load shared with other replicas again")
        self.failing = False
        others: dict[str, Elsewhere] = {}
        for name, entries in zip(held, replies[2::3], strict=True):
            counts = [
                _count(value, now, self.stale_seconds)
                for replica, value in entries.items()
                if replica.decode() != self.replica
            ]
            live = [count for count in counts if count is not None]
            others[name] = Elsewhere(sum(live), len(live))
        return others

    async def claim(self, name: str, held: int, limit: int) -> tuple[bool, int | None]:
        """Whether this replica may hold ``held`` requests at upstream ``name`` (the new
        one among them) with the others' within ``limit``, recorded if so; and what the
        others hold (None: Redis did not answer, and the place is taken as if alone)."""
        now = time.time()
        try:
            reply = await self._claim(
                keys=[KEY.format(name=name)],
                args=[self.replica, held, limit, f"{now:.3f}", self.stale_seconds, self._ttl],
            )
        except (redis.exceptions.RedisError, OSError):
            return True, None
        others = int(reply)
        return (True, others) if others >= 0 else (False, -1 - others)

    async def close(self, names: list[str]) -> None:
        """Withdraw this replica's entries (it holds nothing any more)."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hdel(KEY.format(name=name), self.replica)
                await pipe.execute()
        except (redis.exceptions.RedisError, OSError):
            pass  # they go stale by themselves
        await self.client.aclose()


def _count(value: bytes, now: float, stale_seconds: float) -> int | None:
    """An entry's count, None for a replica gone (or an entry not understood)."""
    try:
        count, written = value.decode().split()
        return int(count) if now - float(written) <= stale_seconds else None
    except ValueError:
        return None


class Placed(Protocol):
    """An upstream as :class:`PoolShare` sees it (``pool.Upstream``)."""

    @property
    def name(self) -> str: ...

    outstanding: dict[str, int]
    limit: int
    held_elsewhere: int
    replicas_elsewhere: int
    allowance: int | None


class PoolShare:
    """The pool's side: claims a place before a request goes to an upstream, keeps each
    upstream's ``held_elsewhere`` and ``replicas_elsewhere`` current, and calls
    ``changed`` when they move (the seats follow)."""

    def __init__(
        self, held: HeldElsewhere, upstreams: Sequence[Placed], changed: Callable[[], None]
    ) -> None:
        self.held = held
        self.upstreams = upstreams
        self.changed = changed
        self._let_go = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.exchange()
        self._task = asyncio.create_task(self._loop(), name="sluicegate-upstream-share")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.held.close([u.name for u in self.upstreams])

    def let_go(self) -> None:
        """A place was let go of here: tell the others at once."""
        self._let_go.set()

    async def claim(self, upstream: Placed) -> bool:
        """Take the place the request just held there asks for, in the shared count
        (False: another replica took the last one first)."""
        granted, others = await self.held.claim(
            upstream.name, len(upstream.outstanding), upstream.limit
        )
        if others is not None and others != upstream.held_elsewhere:
            upstream.held_elsewhere = others
            self.changed()
        return granted

    async def _loop(self) -> None:
        """Exchange at once when a place is let go of here (a take is claimed), else every
        interval."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._let_go.wait(), self.held.interval_seconds)
            await self.exchange()

    async def exchange(self) -> None:
        self._let_go.clear()
        others = await self.held.exchange({u.name: len(u.outstanding) for u in self.upstreams})
        changed = False
        for upstream in self.upstreams:
            seen = Elsewhere() if others is None else others.get(upstream.name, Elsewhere())
            allowance = _allowance(upstream, seen)
            changed |= (seen.held, seen.replicas, allowance) != (
                upstream.held_elsewhere,
                upstream.replicas_elsewhere,
                upstream.allowance,
            )
            upstream.held_elsewhere, upstream.replicas_elsewhere = seen.held, seen.replicas
            upstream.allowance = allowance
        if changed:
            self.changed()


def _allowance(upstream: Placed, seen: Elsewhere) -> int | None:
    """The places a replica may fill until the next exchange, beside live others: those
    it holds and an even share of the free ones.  Fixed between exchanges: counted again
    at every take, with the others' counts as of the last exchange, each replica would
    see its own takes shrink the free places but not the others', and replicas starting
    a burst together would send more than the limit, the rest waiting for a place
    where admission does not see them.  None alone."""
    if not seen.replicas:
        return None
    own = len(upstream.outstanding)
    free = max(0, upstream.limit - own - seen.held)
    return own + math.ceil(free / (1 + seen.replicas))
