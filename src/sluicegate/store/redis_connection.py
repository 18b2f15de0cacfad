"""One Redis client with the store's failure handling around every command.

redis-py's own retries are off: a retried ``append`` or bucket script whose first reply
was lost would run twice (a duplicated event, a double charge).  Instead
:meth:`RedisConnection.run` retries once only what is idempotent, and after a failure
fails fast for ``retry_interval_seconds`` (so an outage costs each request nothing, not
a connect timeout) before trying Redis again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sluicegate.store.errors import StoreUnavailable
from sluicegate.store.records import StoreConfig, StoreCounters

logger = logging.getLogger("sluicegate.store")

T = TypeVar("T")

#: Errors that mean "Redis is not reachable", as opposed to a bug in a command.
UNREACHABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    OSError,
    TimeoutError,
)


def redact_url(url: str) -> str:
    """``url`` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class RedisConnection:
    """The client, the URL, and whether Redis was reachable last time we asked."""

    def __init__(self, url: str, config: StoreConfig, counters: StoreCounters) -> None:
        self.url = redact_url(url)
        self.config = config
        self.counters = counters
        self.client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=config.operation_timeout_seconds,
            socket_connect_timeout=config.connect_timeout_seconds,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        self._available = True
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        return self._available

    async def connect(self) -> None:
        """PING Redis; raise :class:`StoreUnavailable` naming the URL if it does not answer."""
        try:
            await self.client.ping()
        except UNREACHABLE_ERRORS as error:
            raise StoreUnavailable(
                f"cannot reach the Redis store at {self.url} (--store): {error}. Start Redis "
                "or fix the URL (redis://HOST:PORT/DB), or use --store memory for a single "
                "replica."
            ) from error
        except redis.exceptions.RedisError as error:
            raise StoreUnavailable(
                f"the Redis store at {self.url} (--store) refused the connection: {error}"
            ) from error
        self._available = True

    async def close(self) -> None:
        await self.client.aclose()

    async def run(
        self,
        operation: str,
        call: Callable[[aioredis.Redis], Awaitable[T]],
        *,
        idempotent: bool,
    ) -> T:
        """Run ``call(client)``; raise :class:`StoreUnavailable` if Redis is unreachable.

        ``idempotent`` calls are retried once at once (a connection that died while
        idle in the pool); others are not, since their first attempt may have run.
        """
        if not self._available and time.monotonic() < self._retry_at:
            raise StoreUnavailable(
                f"the Redis store at {self.url} is unreachable (retrying every "
                f"{self.config.retry_interval_seconds:g}s)",
                operation=operation,
            )
        attempts = 2 if idempotent else 1
        for attempt in range(attempts):
            try:
                result = await call(self.client)
            except UNREACHABLE_ERRORS as error:
                if attempt + 1 < attempts:
                    continue
                self._mark_down(error)
                raise StoreUnavailable(
                    f"the Redis store at {self.url} is unreachable: {error}",
                    operation=operation,
                ) from error
            if not self._available:
                self._available = True
                logger.info("store %s is reachable again", self.url)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _mark_down(self, error: BaseException) -> None:
        self._retry_at = time.monotonic() + self.config.retry_interval_seconds
        if self._available:
            self._available = False
            self.counters.outages_total += 1
            logger.error("store %s became unreachable: %s", self.url, error)
