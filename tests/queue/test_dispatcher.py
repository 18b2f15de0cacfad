"""The dispatcher with a fake engine side: queue order, waiting for room, refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from sluicegate.admission.controller import AdmissionController, Admitted
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.tenants import Tenant, TenantRegistry
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.queue.dispatcher import Dispatcher
from sluicegate.queue.fair_queue import FairQueueConfig
from sluicegate.queue.ticket import Ticket, TicketState
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.types import PriorityClass

TENANT = Tenant("default")


class Harness:
    def __init__(
        self, *, max_num_seqs: int = 1, max_queued: int = 8, policy: str = "reject",
        wait_seconds: float = 30.0,
    ) -> None:  # fmt: skip
        self.capacity = DispatchCapacity(max_num_seqs, 1 << 20, 16)
        self.admission = AdmissionController(TenantRegistry())
        self.metrics = Metrics("sim")
        self.submitted: list[str] = []
        self.refused: list[Ticket] = []
        self.dispatcher = Dispatcher(
            FairQueueConfig.uniform(max_queued, policy=policy),
            {},
            self.capacity,
            ServiceRateEstimator(),
            self.metrics,
            max_queue_wait_seconds=wait_seconds,
            submit=lambda t: self.submitted.append(t.request_id),
            on_refused=self.refused.append,
        )
        self.capacity.on_change = self.dispatcher.wake

    def ticket(self, rid: str, pc: PriorityClass = PriorityClass.INTERACTIVE) -> Ticket:
        request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, seed=1))
        admitted = self.admission.admit(TENANT, pc, 3, 8)
        assert isinstance(admitted, Admitted)
        return Ticket(request, TENANT, pc, admitted, time.monotonic())

    def rejections(self, reason: str) -> float:
        return self.metrics.rejections_total.labels(reason)._value.get()


async def test_dispatches_at_once_while_there_is_room_then_queues_in_order() -> None:
    h = Harness(max_num_seqs=1)
    first, second, third = h.ticket("a"), h.ticket("b"), h.ticket("c", PriorityClass.BATCH)
    await h.dispatcher.enqueue(first)
    assert h.submitted == ["a"] and first.state is TicketState.DISPATCHED
    await h.dispatcher.enqueue(third)
    await h.dispatcher.enqueue(second)
    assert h.submitted == ["a"] and h.dispatcher.num_queued == 2
    assert h.dispatcher.position(second)[0] == 0
    assert h.dispatcher.position(third)[0] == 1  # batch after interactive
    h.dispatcher.start()
    try:
        h.capacity.release("a")  # the scheduler let go of "a": the next one goes
        await asyncio.wait_for(_until(lambda: h.submitted == ["a", "b"]), 1.0)
        h.capacity.release("b")
        await asyncio.wait_for(_until(lambda: h.submitted == ["a", "b", "c"]), 1.0)
    finally:
        await h.dispatcher.stop()


async def test_a_full_queue_refuses_with_retry_after_and_charges_nothing() -> None:
    h = Harness(max_num_seqs=1, max_queued=1)
    await h.dispatcher.enqueue(h.ticket("running"))
    await h.dispatcher.enqueue(h.ticket("queued"))
    refused = h.ticket("refused")
    with pytest.raises(APIError) as info:
        await h.dispatcher.enqueue(refused)
    assert info.value.status_code == 429 and "retry-after" in info.value.headers
    assert refused.state is TicketState.CLOSED and refused.admitted.handle.released
    assert h.rejections("queue_full") == 1


async def test_a_request_that_waits_too_long_is_refused_and_told_why() -> None:
    h = Harness(max_num_seqs=1, wait_seconds=0.1)
    await h.dispatcher.enqueue(h.ticket("running"))
    late = h.ticket("late")
    await h.dispatcher.enqueue(late)
    h.dispatcher.start()
    try:
        await asyncio.wait_for(_until(lambda: bool(h.refused)), 2.0)
    finally:
        await h.dispatcher.stop()
    assert h.refused == [late] and late.rejection is not None
    assert late.rejection.http_status == 503 and late.state is TicketState.CLOSED
    assert h.submitted == ["running"]


async def test_cancel_takes_a_queued_request_out_only() -> None:
    h = Harness(max_num_seqs=1)
    running, queued = h.ticket("running"), h.ticket("queued")
    await h.dispatcher.enqueue(running)
    await h.dispatcher.enqueue(queued)
    assert not h.dispatcher.cancel(running)  # on the engine: the engine aborts it
    assert h.dispatcher.cancel(queued) and h.dispatcher.num_queued == 0
    assert not h.dispatcher.cancel(queued)
    h.dispatcher.finished(running)
    assert running.state is TicketState.CLOSED and running.admitted.handle.released


async def test_drop_oldest_refuses_the_oldest_queued_request() -> None:
    h = Harness(max_num_seqs=1, max_queued=1, policy="drop-oldest")
    await h.dispatcher.enqueue(h.ticket("running"))
    oldest = h.ticket("oldest")
    await h.dispatcher.enqueue(oldest)
    await h.dispatcher.enqueue(h.ticket("newest"))
    assert h.refused == [oldest] and oldest.rejection is not None
    assert "drop-oldest" in oldest.rejection.message


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110 - polls what a callback sets
        await asyncio.sleep(0.005)
