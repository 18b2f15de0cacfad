"""Shared token buckets: the Redis script must behave exactly like ``TokenBucket``."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from sluicegate.store.base import SharedBucket
from sluicegate.store.memory import MemoryStore
from sluicegate.store.records import StoreConfig
from sluicegate.store.redis_store import RedisStore
from sluicegate.store.token_bucket import Acquire, TokenBucket
from tests.fake_clock import FakeClock
from tests.store.conftest import BACKENDS, TEST_CONFIG, MakeStore, RedisServer


def burst_pattern(seed: int, steps: int) -> list[tuple[float, str, float]]:
    """``(advance_seconds, op, n)`` steps: bursts, float-noise waits, debt, refunds."""
    rng = random.Random(seed)
    waits = [0.0, 0.0, 0.001, 0.1, 0.30000000000000004 - 0.2, 0.25, 1.7, 13.0]
    ops = ["acquire"] * 6 + ["charge", "refund", "peek"]
    pattern = []
    for _ in range(steps):
        op = rng.choice(ops)
        n = rng.choice([1.0, 1.0, 2.0, 0.5, 3.25, 7.0, 9.0, 40.0])
        pattern.append((rng.choice(waits), op, n))
    return pattern


async def run_step(bucket: SharedBucket, op: str, n: float) -> object:
    if op == "acquire":
        return await bucket.try_acquire(n)
    if op == "charge":
        await bucket.charge(n)
        return None
    if op == "refund":
        await bucket.refund(n)
        return None
    return await bucket.peek()


def reference_step(bucket: TokenBucket, op: str, n: float) -> object:
    if op == "acquire":
        return bucket.try_acquire(n)
    if op == "charge":
        bucket.charge(n)
        return None
    if op == "refund":
        bucket.refund(n)
        return None
    return bucket.peek()


def as_tuple(value: object) -> object:
    if isinstance(value, Acquire):
        return (
            value.admitted,
            value.remaining,
            value.retry_after_seconds,
            value.reset_seconds,
            value.exceeds_burst,
        )
    return value


@pytest.fixture
def redis_url_or_none(request: pytest.FixtureRequest) -> str | None:
    if "redis" not in request.node.callspec.params.get("backend", ""):
        return None
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("rate", "burst"), [(3.7, 7.0), (10.0, 1.0), (1000.0 / 60.0, 1000.0)])
async def test_bucket_matches_token_bucket_exactly_on_a_burst_pattern(
    backend: str, rate: float, burst: float, redis_url_or_none: str | None
) -> None:
    clock = FakeClock(1_000_000.0)
    reference = TokenBucket(rate, burst, clock)
    store: MemoryStore | RedisStore
    if backend == "memory":
        store = MemoryStore(TEST_CONFIG, clock=clock)
    else:
        assert redis_url_or_none is not None
        store = RedisStore(
            redis_url_or_none, StoreConfig(key_prefix=f"exact{time.time_ns()}"), bucket_clock=clock
        )
    async with store:
        bucket = store.bucket("tenant:requests", rate, burst)
        for i, (advance, op, n) in enumerate(burst_pattern(int(rate * burst), 300)):
            clock.advance(advance)
            expected = as_tuple(reference_step(reference, op, n * burst / 7.0))
            got = as_tuple(await run_step(bucket, op, n * burst / 7.0))
            assert got == expected, (i, op, n)


@pytest.mark.slow  # Redis: a server process
async def test_redis_bucket_on_the_server_clock_refills_at_the_rate(
    make_store: MakeStore,
) -> None:
    store = await make_store("redis")
    bucket = store.bucket("clock", rate_per_second=20.0, burst=3.0)
    assert [(await bucket.try_acquire()).admitted for _ in range(3)] == [True] * 3
    refused = await bucket.try_acquire()
    assert not refused.admitted
    assert 0.0 < refused.retry_after_seconds <= 0.05 + 1e-9
    assert refused.reset_seconds == pytest.approx(3 / 20, abs=0.01)
    await asyncio.sleep(refused.retry_after_seconds + 0.01)
    assert (await bucket.try_acquire()).admitted
    too_big = await bucket.try_acquire(4.0)
    assert too_big.exceeds_burst and math.isinf(too_big.retry_after_seconds)


@pytest.mark.slow  # Redis: a server process
async def test_two_replicas_share_one_limit(make_store: MakeStore) -> None:
    """Two stores = two replicas with their own connections: R per second in total."""
    rate, burst = 20.0, 5.0
    replicas = [await make_store("redis"), await make_store("redis")]
    buckets = [r.bucket("acme:requests", rate, burst) for r in replicas]
    admitted = [0, 0]
    started = time.monotonic()
    deadline = started + 0.5

    async def hammer(index: int) -> None:
        while time.monotonic() < deadline:
            admitted[index] += (await buckets[index].try_acquire()).admitted
            await asyncio.sleep(0.002)

    await asyncio.gather(hammer(0), hammer(1))
    elapsed = time.monotonic() - started
    total = sum(admitted)
    assert all(admitted), admitted  # both replicas were served …
    # … from one bucket: burst + rate·t in total, where separate buckets would give twice.
    assert burst + rate * 0.5 - 1 <= total <= burst + rate * elapsed + 1, (total, elapsed)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_charge_puts_the_bucket_in_debt_and_refund_caps_at_burst(
    backend: str, make_store: MakeStore
) -> None:
    store = await make_store(backend)
    bucket = store.bucket("debt", rate_per_second=1.0, burst=10.0)
    assert (await bucket.try_acquire(4)).admitted
    await bucket.charge(20)  # the request used far more than it reserved
    tokens, reset_seconds = await bucket.peek()
    assert tokens == pytest.approx(-14.0, abs=0.05)
    assert reset_seconds == pytest.approx(24.0, abs=0.05)
    refused = await bucket.try_acquire(1)
    assert not refused.admitted and refused.retry_after_seconds == pytest.approx(15.0, abs=0.05)
    await bucket.refund(1000)
    tokens, reset_seconds = await bucket.peek()
    assert (tokens, reset_seconds) == (10.0, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_bucket_parameters_are_checked(backend: str, make_store: MakeStore) -> None:
    store = await make_store(backend)
    with pytest.raises(ValueError, match="rate_per_second"):
        store.bucket("bad", 0.0, 1.0)
    with pytest.raises(ValueError, match="burst"):
        store.bucket("bad", 1.0, math.inf)
