from __future__ import annotations

import random

import pytest

from sluicegate.admission.concurrency import ConcurrencyLimiter, ConcurrencySlot


def test_limit_is_enforced_and_release_is_idempotent() -> None:
    limiter = ConcurrencyLimiter(2, "t")
    first = limiter.try_acquire()
    second = limiter.try_acquire()
    assert first is not None and second is not None
    assert limiter.try_acquire() is None
    assert limiter.in_flight == 2 and limiter.available == 0
    assert first.release() is True
    assert first.release() is False
    assert first.released
    assert limiter.in_flight == 1
    third = limiter.try_acquire()
    assert third is not None
    assert limiter.try_acquire() is None


def test_context_manager_releases_on_error() -> None:
    limiter = ConcurrencyLimiter(1)
    slot = limiter.try_acquire()
    assert slot is not None
    with pytest.raises(RuntimeError), slot:
        raise RuntimeError("boom")
    assert limiter.in_flight == 0
    assert slot.release() is False


def test_unlimited_still_counts() -> None:
    limiter = ConcurrencyLimiter(None)
    slots = [limiter.try_acquire() for _ in range(1000)]
    assert limiter.in_flight == 1000
    assert limiter.available is None and limiter.has_room()
    for slot in slots:
        assert slot is not None
        slot.release()
    assert limiter.in_flight == 0


def test_random_acquire_release_never_leaks_or_goes_negative() -> None:
    rng = random.Random(7)
    limiter = ConcurrencyLimiter(5)
    held: list[ConcurrencySlot] = []
    for _ in range(10_000):
        action = rng.random()
        if action < 0.5:
            slot = limiter.try_acquire()
            if slot is not None:
                held.append(slot)
        elif held:
            # Release a random slot, sometimes twice, sometimes an old released one.
            slot = rng.choice(held)
            slot.release()
            if rng.random() < 0.3:
                slot.release()
            held = [s for s in held if not s.released]
        assert 0 <= limiter.in_flight <= 5
        assert limiter.in_flight == len(held)
    for slot in held:
        slot.release()
    assert limiter.in_flight == 0


def test_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ConcurrencyLimiter(-1)
