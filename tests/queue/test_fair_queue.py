from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from sluicegate.admission.decision import RejectReason
from sluicegate.queue.fair_queue import (
    ClassLimits,
    FairQueue,
    FairQueueConfig,
    OfferStatus,
    OverflowPolicy,
    QueueItem,
)
from sluicegate.types import PriorityClass

INTERACTIVE = PriorityClass.INTERACTIVE
BATCH = PriorityClass.BATCH
_ids = itertools.count()


def item(
    tenant: str, num_tokens: int = 100, pc: PriorityClass = INTERACTIVE, at: float = 0.0
) -> QueueItem:
    return QueueItem(f"{tenant}-{next(_ids)}", tenant, pc, num_tokens, at, payload={"t": tenant})


def unbounded() -> FairQueueConfig:
    return FairQueueConfig.uniform(None)


def serve(queue: FairQueue) -> QueueItem | None:
    """Pop and charge the item's tokens, as the dispatcher would."""
    popped = queue.pop_next()
    if popped is not None:
        queue.record_served(popped.tenant, popped.num_tokens)
    return popped


def test_interactive_is_always_served_before_batch() -> None:
    queue = FairQueue(unbounded())
    batch = [item("b", pc=BATCH) for _ in range(3)]
    for it in batch:
        assert queue.offer(it).admitted
    interactive = item("a")
    assert queue.offer(interactive).admitted
    assert serve(queue) is interactive
    assert [serve(queue) for _ in range(3)] == batch
    assert queue.pop_next() is None


@pytest.mark.parametrize(("weight_a", "weight_b"), [(1.0, 1.0), (1.0, 2.0), (3.0, 1.0)])
def test_a_tenant_flooding_at_10x_gets_only_its_weighted_share(
    weight_a: float, weight_b: float
) -> None:
    rng = random.Random(11)
    queue = FairQueue(unbounded(), weights={"flood": weight_a, "steady": weight_b})
    served: Counter[str] = Counter()
    # Each tick: "flood" offers 10 requests, "steady" 1; the server serves 1.  Both stay
    # backlogged, so each should get its weighted share of the *tokens*.
    for tick in range(3000):
        for _ in range(10):
            queue.offer(item("flood", rng.randint(50, 500), at=tick))
        queue.offer(item("steady", rng.randint(50, 500), at=tick))
        popped = serve(queue)
        assert popped is not None
        if tick >= 100:  # after the warm-up both are backlogged
            served[popped.tenant] += popped.num_tokens
    share_b = served["steady"] / (served["steady"] + served["flood"])
    expected_b = weight_b / (weight_a + weight_b)
    assert share_b == pytest.approx(expected_b, rel=0.10)


def test_equal_tenants_alternate() -> None:
    queue = FairQueue(unbounded())
    for _ in range(50):
        queue.offer(item("flood"))
    for _ in range(5):
        queue.offer(item("light"))
    order = [serve(queue) for _ in range(10)]
    assert [i.tenant for i in order if i is not None] == ["flood", "light"] * 5


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = FairQueue(unbounded())
    for _ in range(100):
        queue.offer(item("busy"))
    for _ in range(90):
        serve(queue)
    assert queue.virtual_tokens("busy") == 9000
    # "late" arrives after busy was served 90 times: it is lifted, not owed 90 turns.
    for _ in range(10):
        queue.offer(item("late"))
    assert queue.virtual_tokens("late") == 9000
    order = [serve(queue) for _ in range(10)]
    assert Counter(i.tenant for i in order if i is not None) == {"busy": 5, "late": 5}


def test_a_tenant_returning_to_an_empty_class_is_lifted_to_the_last_served() -> None:
    queue = FairQueue(unbounded())
    queue.offer(item("early"))
    serve(queue)  # early: 100
    for _ in range(20):
        queue.offer(item("other"))
    while len(queue):
        serve(queue)  # other: 2000, and the class runs empty
    queue.offer(item("early"))
    assert queue.virtual_tokens("early") == pytest.approx(2000 - 100)  # lifted to "other"'s last
    assert queue.virtual_tokens("early") >= queue.virtual_tokens("other") - 100


def test_policy_reject_is_bounded_by_requests() -> None:
    queue = FairQueue(FairQueueConfig.uniform(3, policy="reject"))
    assert all(queue.offer(item("a")).admitted for _ in range(3))
    result = queue.offer(item("a"))
    assert result.status is OfferStatus.REJECTED
    assert result.reason is RejectReason.QUEUE_FULL
    assert result.detail == "interactive max_queued_requests limit of 3 reached"
    assert not result.never_fits
    assert len(queue) == 3
    assert queue.offer(item("b", pc=BATCH)).admitted  # the other class has its own bound
    rejection = result.to_rejection(retry_after_seconds=2.5)
    assert rejection.http_status == 429 and rejection.reason is RejectReason.QUEUE_FULL
    assert "interactive max_queued_requests limit of 3 reached" in rejection.message
    assert rejection.headers() == {"retry-after": "3", "retry-after-ms": "2500"}


def test_bounded_by_tokens() -> None:
    queue = FairQueue(FairQueueConfig.uniform(None, max_queued_tokens=1000))
    assert queue.offer(item("a", 400)).admitted
    assert queue.offer(item("a", 400)).admitted
    result = queue.offer(item("a", 400))
    assert not result.admitted
    assert result.detail == "interactive max_queued_tokens limit of 1000 reached"
    assert queue.offer(item("a", 200)).admitted  # exactly full
    assert queue.num_queued_tokens() == 1000
    too_big = queue.offer(item("a", 1001))
    assert too_big.never_fits
    assert "1001 tokens" in too_big.detail and "lower max_tokens" in too_big.detail
    rejection = too_big.to_rejection(retry_after_seconds=5.0)
    assert rejection.http_status == 400 and rejection.retry_after_seconds is None
    assert rejection.error_code == "request_too_large"


def test_global_limits_cover_both_classes() -> None:
    config = FairQueueConfig(
        ClassLimits(10, None), ClassLimits(10, None), max_queued_requests=3, max_queued_tokens=250
    )
    queue = FairQueue(config)
    assert queue.offer(item("a", 100)).admitted
    assert queue.offer(item("b", 100, pc=BATCH)).admitted
    result = queue.offer(item("a", 100))
    assert result.detail == "total max_queued_tokens limit of 250 reached"
    assert queue.offer(item("a", 50)).admitted
    assert queue.offer(item("a", 0)).detail == "total max_queued_requests limit of 3 reached"


def test_drop_oldest_evicts_the_oldest_of_the_same_class() -> None:
    freed: list[int] = []
    queue = FairQueue(
        FairQueueConfig.uniform(3, max_queued_tokens=1000, policy="drop-oldest"),
        on_space_freed=lambda: freed.append(1),
    )
    first, second, third = item("a", 300), item("b", 300), item("a", 300)
    batch = item("z", 300, pc=BATCH)
    for it in (first, second, third, batch):
        assert queue.offer(it).admitted
    newcomer = item("c", 300)
    result = queue.offer(newcomer)
    assert result.admitted
    assert result.evicted == (first,)
    assert first.id not in queue and newcomer.id in queue
    # A big one needs room in tokens too: two more go.
    big = item("c", 700)
    result = queue.offer(big)
    assert result.evicted == (second, third)
    assert queue.num_queued(INTERACTIVE) == 2 and queue.num_queued_tokens(INTERACTIVE) == 1000
    assert batch.id in queue  # the other class is never touched
    assert freed == [1, 1]


def test_drop_oldest_that_cannot_make_room_evicts_nothing() -> None:
    config = FairQueueConfig(
        ClassLimits(5, None, OverflowPolicy.DROP_OLDEST),
        ClassLimits(5, None),
        max_queued_requests=2,
    )
    queue = FairQueue(config)
    assert queue.offer(item("b", pc=BATCH)).admitted
    assert queue.offer(item("b", pc=BATCH)).admitted
    result = queue.offer(item("a"))  # only batch items fill the global bound
    assert result.status is OfferStatus.REJECTED and result.evicted == ()
    assert len(queue) == 2


def test_block_and_spill_policies_tell_the_caller_what_to_do() -> None:
    freed: list[int] = []
    config = FairQueueConfig(
        ClassLimits(1, None, OverflowPolicy.BLOCK),
        ClassLimits(1, None, OverflowPolicy.SPILL_TO_DISK),
    )
    queue = FairQueue(config, on_space_freed=lambda: freed.append(1))
    assert queue.offer(item("a")).admitted
    assert queue.offer(item("b", pc=BATCH)).admitted
    waiting = item("a")
    blocked = queue.offer(waiting)
    assert blocked.status is OfferStatus.MUST_WAIT and blocked.reason is RejectReason.QUEUE_FULL
    spilled = queue.offer(item("b", pc=BATCH))
    assert spilled.status is OfferStatus.SPILL
    assert not freed
    serve(queue)
    assert freed == [1]  # the waiter's event is set; it offers again
    assert queue.offer(waiting).admitted


def test_remove_and_expire() -> None:
    freed: list[int] = []
    queue = FairQueue(unbounded(), on_space_freed=lambda: freed.append(1))
    items = [item("a", at=float(t)) for t in range(5)] + [item("b", pc=BATCH, at=2.5)]
    for it in items:
        queue.offer(it)
    assert queue.remove(items[1].id) is items[1]
    assert queue.remove(items[1].id) is None
    assert queue.oldest_enqueued_at() == 0.0
    expired = queue.expire(now=10.0, max_wait_seconds=7.0)  # waited more than 7 s: t < 3
    assert expired == [items[0], items[2], items[5]]
    assert len(queue) == 2 and queue.num_queued_tokens() == 200
    assert queue.expire(now=10.0, max_wait_seconds=7.0) == []
    assert queue.expire(now=100.0, max_wait_seconds=7.0, priority_class=BATCH) == []
    assert freed == [1, 1]


def test_duplicate_ids_are_refused() -> None:
    queue = FairQueue(unbounded())
    it = item("a")
    queue.offer(it)
    with pytest.raises(ValueError, match="already queued"):
        queue.offer(it)


def test_position_of_a_single_tenant_is_fifo() -> None:
    queue = FairQueue(unbounded())
    items = [item("a", 10 * (i + 1)) for i in range(5)]
    for it in items:
        queue.offer(it)
    assert [queue.position(it.id) for it in items] == [0, 1, 2, 3, 4]
    assert [queue.queued_tokens_ahead(it.id) for it in items] == [0, 10, 30, 60, 100]
    with pytest.raises(KeyError):
        queue.position("nope")


@pytest.mark.parametrize("seed", range(5))
def test_position_predicts_the_pop_order(seed: int) -> None:
    rng = random.Random(seed)
    tenants = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 1.0}
    queue = FairQueue(unbounded(), weights=tenants)
    for tenant in tenants:  # some history, so counters differ
        queue.record_served(tenant, rng.randint(0, 2000))
    items = []
    for _ in range(200):
        pc = INTERACTIVE if rng.random() < 0.7 else BATCH
        it = item(rng.choice(list(tenants)), rng.randint(1, 400), pc=pc)
        items.append(it)
        queue.offer(it)
    predicted = {it.id: queue.position(it.id) for it in items}
    tokens_ahead = {it.id: queue.queued_tokens_ahead(it.id) for it in items}
    served_tokens = 0
    for actual in range(len(items)):
        popped = serve(queue)
        assert popped is not None
        assert predicted[popped.id] == actual
        assert tokens_ahead[popped.id] == served_tokens
        served_tokens += popped.num_tokens
