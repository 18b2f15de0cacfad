"""The places gateway replicas share at an upstream, against a real Redis: a claim is
granted only while everyone's count stays within the limit (never both of two replicas
for the last place), an exchange reports what the others hold, a replica gone stops
counting, and a Redis that does not answer leaves each replica counting alone."""

from __future__ import annotations

import time

import pytest

from sluicegate.engine.upstream.share import KEY, Elsewhere, HeldElsewhere
from tests.resume.conftest import redis_url as redis_url  # the session's Redis fixture

pytestmark = pytest.mark.slow


async def test_the_last_place_goes_to_one_replica(redis_url: str) -> None:
    url = f"{redis_url}/6"
    one, two = HeldElsewhere(url, 0.1, "one"), HeldElsewhere(url, 0.1, "two")
    try:
        await one.client.delete(KEY.format(name="u"))
        assert await one.claim("u", 3, 4) == (True, 0)
        assert await two.claim("u", 1, 4) == (True, 3)  # 3 + 1: the last place
        assert await one.claim("u", 4, 4) == (False, 1)  # not both
        assert await two.claim("u", 2, 4) == (False, 3)
        assert await one.exchange({"u": 2}) == {"u": Elsewhere(1, 1)}  # one let one go
        assert await two.claim("u", 2, 4) == (True, 2)
        # A replica that stopped writing stops counting once its entry is stale.
        stale = f"4 {time.time() - 2 * one.stale_seconds:.3f}"
        await one.client.hset(KEY.format(name="u"), "gone", stale)
        assert await one.exchange({"u": 2}) == {"u": Elsewhere(2, 1)}
    finally:
        await one.close(["u"])
        await two.close(["u"])


async def test_without_redis_a_replica_counts_alone() -> None:
    lost = HeldElsewhere("redis://127.0.0.1:1/0", 0.1, "alone")
    try:
        assert await lost.claim("u", 9, 4) == (True, None)
        assert await lost.exchange({"u": 1}) is None
        assert lost.failing
    finally:
        await lost.close(["u"])
