"""The dispatcher with a fake engine side: queue order, waiting for room, refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from sluicegate.admission.controller import AdmissionController, Admitted
from sluicegate.admission.objectives import Objectives
from sluicegate.admission.request_objective import RequestObjective
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.slo import SLOAdmission, TTFTPredictor
from sluicegate.admission.tenants import Tenant, TenantRegistry
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.queue.dispatcher import Dispatcher
from sluicegate.queue.fair_queue import FairQueueConfig
from sluicegate.queue.ticket import Ticket, TicketState
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.types import PriorityClass
from tests.fake_clock import FakeClock

TENANT = Tenant("default")
#: Only a broken dispatcher takes this long to act on a change (it acts at once).
DEADLINE_SECONDS = 30.0


class Harness:
    def __init__(
        self,
        *,
        max_num_seqs: int = 1,
        max_queued: int = 8,
        policy: str = "reject",
        wait_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
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
        return Ticket(request, TENANT, pc, admitted, self.clock())

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
        await asyncio.wait_for(_until(lambda: h.submitted == ["a", "b"]), DEADLINE_SECONDS)
        h.capacity.release("b")
        await asyncio.wait_for(_until(lambda: h.submitted == ["a", "b", "c"]), DEADLINE_SECONDS)
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
        await asyncio.wait_for(_until(lambda: bool(h.refused)), DEADLINE_SECONDS)
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


# --- admission by objective ---

# One seat, 0.5 s a request: two starts a second.
ESTIMATE = ServiceEstimate(
    seat_limit=1,
    step_seconds=0.05,
    mean_prompt_tokens=0.0,
    mean_output_tokens=10.0,
    max_num_batched_tokens=512,
    cost=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
)


def slo_harness(clock: FakeClock) -> Harness:
    h = Harness(max_num_seqs=1, clock=clock)
    predictor = TTFTPredictor(lambda: ESTIMATE, clock)
    objectives = {
        PriorityClass.INTERACTIVE: Objectives(1.0, 0.1),
        PriorityClass.BATCH: Objectives(30.0, 0.5),
    }
    h.dispatcher.slo = SLOAdmission(predictor, objectives)
    return h


async def test_a_request_that_would_miss_its_objective_is_refused_at_once() -> None:
    clock = FakeClock()
    h = slo_harness(clock)
    await h.dispatcher.enqueue(h.ticket("running"))  # the one seat
    first = h.ticket("first")
    await h.dispatcher.enqueue(first)
    # "running" has 8 tokens to go at 50 ms a step: "first" starts in 0.4 s.
    assert first.predicted_wait_seconds == pytest.approx(0.4)
    await h.dispatcher.enqueue(h.ticket("second"))  # 0.8 s: still within
    refused = h.ticket("third")
    with pytest.raises(APIError) as info:
        await h.dispatcher.enqueue(refused)
    error = info.value
    assert error.status_code == 429 and error.code == "slo_unreachable"
    assert float(error.headers["retry-after-ms"]) >= 500  # when its slot comes
    assert refused.state is TicketState.CLOSED and refused.admitted.handle.released
    assert h.rejections("slo_unreachable") == 1
    # Batch work is not refused by objective: it waits its turn.
    await h.dispatcher.enqueue(h.ticket("batch", PriorityClass.BATCH))
    assert h.dispatcher.num_queued == 3


async def test_a_queued_request_whose_deadline_slips_is_told_at_once() -> None:
    clock = FakeClock()
    h = slo_harness(clock)
    await h.dispatcher.enqueue(h.ticket("running"))
    waiting = h.ticket("waiting")
    await h.dispatcher.enqueue(waiting)
    clock.advance(0.8)  # "running" holds its seat longer than predicted
    h.dispatcher._refuse_unreachable(clock.now)
    assert not h.refused
    clock.advance(0.5)
    h.dispatcher._refuse_unreachable(clock.now)
    assert h.refused == [waiting] and waiting.rejection is not None
    assert waiting.rejection.reason.value == "slo_unreachable"
    assert waiting.rejection.http_status == 429


async def test_a_client_back_at_its_time_takes_its_seat_even_after_the_limit_is_cut() -> None:
    clock = FakeClock()
    h = slo_harness(clock)
    h.capacity = DispatchCapacity(3, 1 << 20, 16)  # three slots, a seat limit of one
    h.dispatcher.capacity = h.capacity
    h.capacity.set_seat_limit(1)

    def ticket(rid: str, prompt: list[int]) -> Ticket:
        admitted = h.admission.admit(TENANT, PriorityClass.INTERACTIVE, 3, 8)
        assert isinstance(admitted, Admitted)
        request = Request(rid, prompt, SamplingParams(max_tokens=8, seed=1))
        return Ticket(request, TENANT, PriorityClass.INTERACTIVE, admitted, clock())

    await h.dispatcher.enqueue(ticket("running", [9]))
    await h.dispatcher.enqueue(ticket("queued-1", [8]))
    await h.dispatcher.enqueue(ticket("queued-2", [7]))
    with pytest.raises(APIError) as info:
        await h.dispatcher.enqueue(ticket("client", [1, 2, 3]))
    assert info.value.headers["x-sluicegate-refusal"] == "slo_unreachable"
    clock.advance(float(info.value.headers["retry-after-ms"]) / 1000.0)
    # It comes back at its time with the same request; the queue is still ahead of it
    # (the engine ran slower than booked).  It takes its seat at once, above the limit.
    back = ticket("client-again", [1, 2, 3])
    await h.dispatcher.enqueue(back)
    assert back.booked and back.state is TicketState.DISPATCHED
    assert h.submitted == ["running", "client-again"]
    # A stranger at the same moment is not taken for it: it waits behind the queue.
    stranger = ticket("stranger", [4, 5, 6])
    await h.dispatcher.enqueue(stranger)
    assert not stranger.booked and stranger.state is TicketState.QUEUED
    assert h.submitted == ["running", "client-again"]


async def test_deadlines_of_requests_no_longer_queued_are_not_kept() -> None:
    h = Harness(max_num_seqs=1000)
    for i in range(500):  # each starts at once: nothing stays queued
        ticket = h.ticket(f"r{i}")
        ticket.objective = RequestObjective(deadline=time.monotonic() + 3600)
        await h.dispatcher.enqueue(ticket)
    assert len(h.submitted) == 500
    assert len(h.dispatcher._deadlines) <= 64 + 1


async def test_the_loop_ticks_only_while_requests_are_queued() -> None:
    """Queued requests expire with time, so the loop looks every tick while any is queued;
    with none, only an event wakes it (an idle server does not wake 20 times a second)."""
    h = Harness(max_num_seqs=1, wait_seconds=30.0)
    ticks: list[float] = []
    expire = h.dispatcher.queue.expire

    def counted(now: float, max_wait: float) -> Any:
        ticks.append(now)
        return expire(now, max_wait)

    h.dispatcher.queue.expire = counted  # type: ignore[method-assign]
    h.dispatcher.start()
    await asyncio.sleep(0.3)  # six ticks
    assert ticks == []
    await h.dispatcher.enqueue(h.ticket("running"))
    await h.dispatcher.enqueue(h.ticket("queued"))
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(ticks) < 3:
        assert time.monotonic() < deadline, "the loop does not tick while a request waits"
        await asyncio.sleep(0.01)
    await h.dispatcher.stop()
