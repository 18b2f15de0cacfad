"""Redis down at startup or killed at run time: clear errors, the failure mode, no crash."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from sluicegate.store.base import Store
from sluicegate.store.errors import ReplayTrimmed, StoreUnavailable
from sluicegate.store.factory import open_store
from sluicegate.store.records import DegradedOutcome, StoreFailureMode, StreamMeta, StreamStatus
from tests.store.conftest import TEST_CONFIG, MakeStore, RedisServer
from tests.support.servers import free_port

OUTAGE_CONFIG = {"retry_interval_seconds": 0.1}


def meta() -> StreamMeta:
    return StreamMeta(tenant="acme", model="m", prompt_token_ids=[1], seed=7)


async def test_connect_to_a_redis_that_is_not_there_names_the_url() -> None:
    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/3"
    store = open_store(url, TEST_CONFIG)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await store.connect()
    await store.close()
    message = str(info.value)
    assert f"127.0.0.1:{url.rsplit(':', 1)[1]}" in message and "--store" in message
    assert "hunter2" not in message  # the password is never logged
    assert time.monotonic() - started < 2.0


async def test_fail_open_keeps_serving_while_redis_is_dead(
    own_redis: RedisServer, make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = await make_store("redis", url=own_redis.url, **OUTAGE_CONFIG)
    seen: list[tuple[str, DegradedOutcome]] = []
    store.on_degraded = lambda operation, outcome: seen.append((operation, outcome))
    await store.put_meta("s", meta())
    assert await store.append("s", b"1") == 1
    bucket = store.bucket("acme:requests", 1.0, 2.0)
    assert (await bucket.try_acquire()).admitted

    own_redis.kill()
    caplog.set_level(logging.WARNING, logger="sluicegate.store")
    started = time.monotonic()
    assert await store.append("s", b"2") is None  # dropped: send it without an SSE id
    assert not store.available
    for _ in range(5):  # the bucket admits whatever its state was
        assert (await bucket.try_acquire()).admitted
    assert (await bucket.try_acquire(3.0)).exceeds_burst  # larger than the burst: still no
    await bucket.charge(5)
    await bucket.refund(5)
    assert await bucket.peek() == (2.0, 0.0)
    await store.put_meta("s", meta())
    await store.update_meta("s", status=StreamStatus.CHECKPOINTED)
    await store.finish("s")
    assert await store.acquire_lease("s", "me", 5.0)
    assert await store.renew_lease("s", "me", 5.0)
    assert not await store.release_lease("s", "me")
    for read in (store.read("s", 0), store.get_meta("s"), store.lease_owner("s")):
        with pytest.raises(StoreUnavailable, match=own_redis.url.split("//")[1]):
            await read
    with pytest.raises(StoreUnavailable):
        async for _ in store.tail("s", 0):
            pass
    assert time.monotonic() - started < 3.0  # failing fast, not a timeout per call

    counters = store.counters
    assert counters.outages_total == 1
    assert counters.degraded_total("append", DegradedOutcome.DROPPED) == 1
    assert counters.degraded_total("bucket_acquire", DegradedOutcome.ADMITTED) == 5
    assert counters.degraded_total("read", DegradedOutcome.RAISED) == 2  # read, and tail's
    assert counters.degraded_total(outcome=DegradedOutcome.GRANTED) == 2
    assert len(seen) == counters.degraded_total()
    assert "append dropped" in caplog.text and "became unreachable" in caplog.text


async def test_fail_closed_refuses_with_typed_errors_while_redis_is_dead(
    own_redis: RedisServer, make_store: MakeStore
) -> None:
    store = await make_store(
        "redis",
        url=own_redis.url,
        store_failure_mode=StoreFailureMode.FAIL_CLOSED,
        **OUTAGE_CONFIG,
    )
    bucket = store.bucket("acme:requests", 1.0, 2.0)
    await store.append("s", b"1")
    own_redis.kill()
    with pytest.raises(StoreUnavailable) as info:
        await store.append("s", b"2")
    assert info.value.operation == "append"
    with pytest.raises(StoreUnavailable):
        await bucket.try_acquire()
    with pytest.raises(StoreUnavailable):
        await bucket.peek()
    await bucket.refund(1)  # cleanup paths never raise, but are counted
    assert not await store.release_lease("s", "me")
    for write in (
        store.put_meta("s", meta()),
        store.update_meta("s", extra={}),
        store.finish("s"),
        store.acquire_lease("s", "me", 1.0),
        store.renew_lease("s", "me", 1.0),
    ):
        with pytest.raises(StoreUnavailable):
            await write
    assert store.counters.degraded_total("bucket_refund", DegradedOutcome.DROPPED) == 1
    assert store.counters.degraded_total("append", DegradedOutcome.RAISED) == 1


async def test_a_tail_blocked_in_redis_fails_promptly_when_redis_dies(
    own_redis: RedisServer, make_store: MakeStore
) -> None:
    store = await make_store("redis", url=own_redis.url, **OUTAGE_CONFIG)
    await store.append("s", b"1")

    async def reader() -> list[int]:
        return [e.seq async for e in store.tail("s", 0)]

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.05)
    own_redis.kill()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(task, 2.0)


async def test_after_an_outage_the_log_resumes_and_refuses_to_replay_across_the_hole(
    own_redis: RedisServer, make_store: MakeStore
) -> None:
    store = await make_store("redis", url=own_redis.url, **OUTAGE_CONFIG)
    assert [await store.append("s", f"{i}".encode()) for i in (1, 2, 3)] == [1, 2, 3]
    await store.append("t", b"1")
    own_redis.shutdown_saving()
    assert await store.append("s", b"lost-a") is None
    assert await store.append("s", b"lost-b") is None
    assert await store.append("t", b"lost") is None
    own_redis.start()  # with the data saved before the outage (and no scripts loaded)
    await asyncio.sleep(0.15)

    assert await store.append("s", b"4") == 4  # seq continues: it lives in Redis
    assert store.available
    result = await store.read("s", 3)  # a client that saw 3, then maybe lost-a/lost-b
    assert result.trimmed and result.resumable_from_seq == 4
    assert not (await store.read("s", 4)).trimmed
    with pytest.raises(ReplayTrimmed):
        async for _ in store.tail("s", 2):
            pass
    # The hole was at the end: finishing marks it, so no position replays "to the end".
    await store.finish("t")
    assert (await store.read("t", 1)).trimmed


async def test_a_store_opened_before_redis_restarts_recovers_by_itself(
    own_redis: RedisServer, make_store: MakeStore
) -> None:
    store: Store = await make_store("redis", url=own_redis.url, **OUTAGE_CONFIG)
    bucket = store.bucket("k", 10.0, 10.0)
    own_redis.kill()
    with contextlib.suppress(StoreUnavailable):
        await store.read("x", 0)
    own_redis.start()
    await asyncio.sleep(0.15)
    assert await store.append("fresh", b"x") == 1
    assert (await bucket.try_acquire()).admitted
    assert store.counters.outages_total == 1
