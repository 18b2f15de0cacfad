"""``open_store(url)``: the store named by ``--store``."""

from __future__ import annotations

from sluicegate.store.base import Store
from sluicegate.store.memory import MemoryStore
from sluicegate.store.records import StoreConfig

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str, config: StoreConfig | None = None) -> Store:
    """The store for ``url``: ``memory`` or ``redis://HOST:PORT/DB`` (also ``rediss://``,
    ``unix://``).  Not yet connected: ``await store.connect()`` (or ``async with``) at
    startup, which raises :class:`~sluicegate.store.base.StoreUnavailable` naming the URL
    if Redis cannot be reached.
    """
    spec = url.strip()
    if spec == "memory":
        return MemoryStore(config)
    if spec.startswith(_REDIS_SCHEMES):
        # Imported here: the redis client costs a tenth of a second at every start-up.
        from sluicegate.store.redis_store import RedisStore

        return RedisStore(spec, config)
    raise ValueError(
        f"--store must be 'memory' or a Redis URL like redis://HOST:PORT/DB; got {url!r}"
    )
