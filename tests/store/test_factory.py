from __future__ import annotations

import asyncio

import pytest

from sluicegate.store.errors import StreamNotFound
from sluicegate.store.factory import open_store
from sluicegate.store.memory import MemoryStore
from sluicegate.store.records import StoreConfig, StoreFailureMode
from sluicegate.store.redis_connection import redact_url
from sluicegate.store.redis_store import RedisStore
from tests.fake_clock import FakeClock
from tests.store.conftest import RedisServer


async def test_open_store_picks_the_backend_from_the_url(redis_server: RedisServer) -> None:
    memory = open_store("memory")
    assert isinstance(memory, MemoryStore) and memory.url == "memory"
    config = StoreConfig(replay_max_events=7, store_failure_mode=StoreFailureMode.FAIL_CLOSED)
    async with open_store(redis_server.url, config) as store:
        assert isinstance(store, RedisStore)
        assert store.config is config and store.available
        assert await store.append("x", b"1") == 1


def test_open_store_explains_a_bad_url() -> None:
    with pytest.raises(ValueError, match=r"'memory' or a Redis URL like redis://HOST:PORT/DB"):
        open_store("postgres://localhost/db")


def test_urls_are_shown_without_passwords() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://u:pw@h/2") == "redis://u:***@h/2"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replay_max_events": 0}, "replay_max_events must be at least 1"),
        ({"replay_ttl_seconds": 0.0}, "replay_ttl_seconds must be a positive"),
        ({"tail_block_seconds": 5.0}, "must be below operation_timeout_seconds"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"retry_interval_seconds": -1.0}, "retry_interval_seconds"),
    ],
)
def test_config_errors_say_which_limit_is_wrong(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StoreConfig(**fields)  # type: ignore[arg-type]


async def test_memory_store_forgets_expired_streams_and_their_tombstones() -> None:
    clock = FakeClock()
    store = MemoryStore(
        StoreConfig(replay_ttl_seconds=10.0, replay_tombstone_seconds=100.0), clock=clock
    )
    for i in range(50):
        await store.append(f"s{i}", b"x")
    clock.advance(11.0)
    await store.append("new", b"x")  # a write sweeps what expired
    assert set(store._streams) == {"new"} and len(store._tombstones) == 50
    clock.advance(200.0)
    await store.append("newer", b"x")
    assert not store._tombstones  # forgotten: now unknown, not expired
    with pytest.raises(StreamNotFound):
        await store.read("s0", 0)
    await asyncio.sleep(0)
