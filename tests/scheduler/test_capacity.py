"""Dispatch capacity: seats and worst-case KV, owned by the scheduler, asked by the dispatcher."""

from __future__ import annotations

import threading

from sluicegate.scheduler.capacity import DispatchCapacity


def test_seats_and_kv_bound_what_may_be_dispatched() -> None:
    capacity = DispatchCapacity(max_num_seqs=2, kv_capacity_tokens=64, block_size=16)
    assert capacity.kv_tokens_for(1) == 16 and capacity.kv_tokens_for(17) == 32
    assert capacity.try_reserve("a", 30)  # 32 tokens of KV
    assert not capacity.try_reserve("a", 1)  # already holding
    assert not capacity.fits(40)  # 48 more would exceed 64
    assert capacity.try_reserve("b", 20)
    assert capacity.seats_full and not capacity.try_reserve("c", 1)


def test_a_paused_request_gives_up_its_seat_and_takes_it_back() -> None:
    changes: list[int] = []
    capacity = DispatchCapacity(max_num_seqs=1, kv_capacity_tokens=1024, block_size=16)
    capacity.on_change = lambda: changes.append(capacity.num_holding)
    assert capacity.try_reserve("slow", 100)
    capacity.set_idle("slow", True)
    capacity.set_idle("slow", True)  # no change, no call
    assert changes == [0] and capacity.try_reserve("next", 100)
    capacity.set_idle("slow", False)  # resumed: over the limit until one finishes
    assert capacity.num_holding == 2 and not capacity.fits(1)
    capacity.release("next")
    capacity.release("slow")
    capacity.release("unknown")
    assert capacity.num_holding == 0 and changes == [0, 1, 0]


def test_a_paused_request_that_finishes_releases_nothing_twice() -> None:
    capacity = DispatchCapacity(max_num_seqs=2, kv_capacity_tokens=64, block_size=16)
    assert capacity.try_reserve("a", 32)
    capacity.set_idle("a", True)
    capacity.release("a")
    assert capacity.num_holding == 0 and capacity.fits(64)


def test_two_threads_never_over_reserve() -> None:
    capacity = DispatchCapacity(max_num_seqs=50, kv_capacity_tokens=10**9, block_size=1)
    granted: list[bool] = []

    def reserve(prefix: str) -> None:
        for i in range(200):
            granted.append(capacity.try_reserve(f"{prefix}{i}", 1))

    threads = [threading.Thread(target=reserve, args=(p,)) for p in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 50 and capacity.num_holding == 50
