"""The dispatcher: admitted requests wait in the fair queue until the engine has room.

An admitted request is offered to the bounded fair queue (per class and tenant; the
class's overflow policy applies when it is full).  A dispatch loop hands queued requests
to the scheduler only while the scheduler's :class:`DispatchCapacity` has a free seat and
room for the request's worst-case KV footprint, so the scheduler's own waiting line
stays short and the queue in front of it is where waiting happens: bounded, fair, and
able to tell each client its position and expected wait.  Requests that wait longer
than ``max_queue_wait_seconds`` are refused with ``Retry-After``.

With admission by objective (:class:`~sluicegate.admission.slo.SLOAdmission`), a request
of an enforced class whose predicted time to first token misses its objective is refused
at once (``429 slo_unreachable``) instead of queued, and a queued one whose deadline
becomes unreachable is told so as soon as that is known, not after a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import time
from array import array
from collections.abc import Callable, Mapping

from sluicegate.admission.breaker import CircuitBreaker
from sluicegate.admission.decision import (
    Rejection,
    RejectReason,
    deadline_rejection,
    queue_timeout_rejection,
    slo_rejection,
)
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.slo import SLOAdmission
from sluicegate.metrics.registry import Metrics
from sluicegate.queue.fair_queue import FairQueue, FairQueueConfig, OfferStatus, QueueItem
from sluicegate.queue.ticket import Ticket, TicketState
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import Request
from sluicegate.types import PriorityClass

#: How often the loop looks for expired requests when nothing else wakes it.
_TICK_SECONDS = 0.05


class Dispatcher:
    """The fair queue and the loop that feeds the scheduler.  Owned by the event loop.

    ``submit`` hands a ticket's request to the engine; ``on_refused`` tells the ticket's
    owner that the queue refused it after admitting it (``ticket.rejection`` says why).
    """

    def __init__(
        self,
        queue_config: FairQueueConfig,
        weights: Mapping[str, float],
        capacity: DispatchCapacity,
        estimator: ServiceRateEstimator,
        metrics: Metrics,
        *,
        max_queue_wait_seconds: float,
        submit: Callable[[Ticket], None],
        on_refused: Callable[[Ticket], None],
        breaker: CircuitBreaker | None = None,
        slo: SLOAdmission | None = None,
    ) -> None:
        self._space = asyncio.Event()
        self.queue = FairQueue(queue_config, weights=weights, on_space_freed=self._space.set)
        self.capacity = capacity
        self.estimator = estimator
        self.metrics = metrics
        self.breaker = breaker
        self.slo = slo
        self.max_queue_wait_seconds = max_queue_wait_seconds
        self._submit = submit
        self._on_refused = on_refused
        self._wake = asyncio.Event()
        #: (deadline, request id) of queued requests that stated one (a min-heap).
        self._deadlines: list[tuple[float, str]] = []
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_loop(), name="sluicegate-dispatcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        """Room may have appeared in the engine: look at the queue now."""
        self._wake.set()

    # ------------------------------------------------------------- requests
    async def enqueue(self, ticket: Ticket) -> None:
        """Queue an admitted request, or raise the :class:`APIError` that refuses it.

        A refusal releases the ticket's admission (its tenant is not charged).
        """
        request = ticket.request
        refusal = self._predict(ticket)
        if refusal is not None:
            self._close(ticket, 0, 0)
            self.count_rejection(refusal)
            raise refusal.to_error()
        item = QueueItem(
            id=request.request_id,
            tenant=ticket.tenant.name,
            priority_class=ticket.priority_class,
            num_tokens=ticket.max_total_tokens,
            enqueued_at=ticket.enqueued_at,
            payload=ticket,
        )
        if ticket.booked and self.capacity.try_reserve_all(ticket.requests, booked=True):
            self._dispatch(ticket, time.monotonic())  # its promised seat, ahead of the queue
            return
        if ticket.objective.deadline is not None:
            heapq.heappush(self._deadlines, (ticket.objective.deadline, request.request_id))
            if len(self._deadlines) > 2 * len(self.queue) + 64:
                # Those that started or left: dropped, so that the heap stays the queue's
                # size however many requests state a far deadline.
                self._deadlines = [d for d in self._deadlines if d[1] in self.queue]
                heapq.heapify(self._deadlines)
        deadline = ticket.enqueued_at + self.max_queue_wait_seconds
        while True:
            result = self.queue.offer(item)
            if result.status is OfferStatus.ADMITTED:
                break
            if result.status is OfferStatus.MUST_WAIT:
                # Policy "block": wait for space, up to the queue-wait deadline.
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._space.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await self._space.wait()
                    continue
                rejection = queue_timeout_rejection(
                    time.monotonic() - ticket.enqueued_at,
                    self.max_queue_wait_seconds,
                    self.retry_after_seconds(ticket.priority_class),
                )
            else:
                rejection = result.to_rejection(self.retry_after_seconds(ticket.priority_class))
                if result.status is OfferStatus.SPILL:
                    rejection.message += (
                        ' Submit batch work as a background job ("background": true) to have '
                        "it journaled instead."
                    )
            self._close(ticket, 0, 0)
            self.count_rejection(rejection)
            raise rejection.to_error()
        for victim in result.evicted:
            self._refuse(victim, "drop-oldest: a newer request took its place in the full queue")
        self._pump(time.monotonic())  # straight to the engine when it has room
        self._wake.set()  # the loop ticks while anything is queued

    def _predict(self, ticket: Ticket) -> Rejection | None:
        """Under admission by objective: its predicted TTFT, or the refusal that it misses."""
        slo = self.slo
        if slo is None:
            return None
        pc = ticket.priority_class
        predictor = slo.predictor
        holders = self.capacity.holders()
        ahead = self._queued_ahead(pc)
        free = self.capacity.num_free_seats
        # What it must prefill: less what the prefix cache holds of its prompt now.
        peek = self.capacity.cached_prefix
        request = ticket.request
        prompt = request.num_prompt_tokens - (peek(request) if peek else 0)
        stated = ticket.objective
        objective = stated.ttft_or(slo.objectives[pc].ttft_seconds)
        fingerprint = request_fingerprint(ticket)
        prediction = predictor.predict(
            holders, ahead, free, prompt, objective, fingerprint, request
        )
        if stated.deadline is not None:
            now = time.monotonic()
            finish = prediction.wait_seconds + predictor.service_seconds(request)
            if now + finish > stated.deadline:
                return deadline_rejection(finish, stated.deadline - now)
        if prediction.claims_promise:
            # Back at its time for the seat it was promised: it takes it, whatever the
            # prediction says now (the seats may have been cut since the booking).
            ticket.booked = True
            predictor.admitted(fingerprint)
        elif slo.refuses(pc, prediction, stated.ttft_seconds):
            refusal = predictor.refuse(holders, ahead, free, objective, prompt, fingerprint)
            return slo_rejection(
                max(prediction.ttft_seconds, refusal.ttft_behind_seconds)
                if not (prediction.num_promised or prediction.num_delayed)
                else prediction.ttft_seconds,
                objective,
                refusal.retry_after_seconds,
                held=refusal.held,
                promised=prediction.num_promised,
                delayed=prediction.num_delayed,
            )
        for r in ticket.requests:  # what its prefill is paced by (scheduler/prefill.py)
            r.pace.first_token_due = r.arrival_time + objective
        # A booked request starts at once: its predicted wait says nothing of the queue's.
        ticket.predicted_wait_seconds = None if ticket.booked else prediction.wait_seconds
        ticket.predicted_ttft_seconds = prediction.ttft_seconds
        ticket.ttft_margin_seconds = prediction.margin_seconds
        ticket.ttft_objective_seconds = objective
        return None

    def _queued_ahead(self, priority_class: PriorityClass) -> list[Request]:
        """Queued requests that start before a new one of this class, in order."""
        items = self.queue.items(PriorityClass.INTERACTIVE)
        if priority_class is PriorityClass.BATCH:
            items += self.queue.items(PriorityClass.BATCH)
        return [_request(item) for item in items]

    def _refuse_unreachable(self, now: float) -> None:
        """Tell queued requests whose objective has become unreachable, at once."""
        slo = self.slo
        if slo is None:
            return
        predictor = slo.predictor
        holders = self.capacity.holders()
        free = self.capacity.num_free_seats
        for pc in slo.enforced:
            objective = slo.objectives[pc].ttft_seconds
            items = self.queue.items(pc)
            waits = predictor.waits(holders, [_request(i) for i in items], free)
            late: list[tuple[Ticket, float]] = []
            for item, wait in zip(items, waits, strict=True):
                ticket = item.payload
                assert isinstance(ticket, Ticket)
                prompt = ticket.request.num_prompt_tokens
                expected = now - ticket.enqueued_at + wait + predictor.prefill_seconds(prompt)
                if expected > ticket.objective.ttft_or(objective) * slo.late_tolerance:
                    late.append((ticket, expected))
            for ticket, expected in late:
                self.queue.remove(ticket.request_id)
                refusal = predictor.refuse(
                    holders,
                    self._queued_ahead(pc),
                    free,
                    objective,
                    ticket.request.num_prompt_tokens,
                    request_fingerprint(ticket),
                )
                rejection = slo_rejection(
                    expected,
                    ticket.objective.ttft_or(objective),
                    refusal.retry_after_seconds,
                    held=refusal.held,
                )
                self._refuse_with(ticket, rejection)

    def position(self, ticket: Ticket) -> tuple[int, float]:
        """(0-based position, expected wait in seconds) of a queued request."""
        rid = ticket.request_id
        if rid not in self.queue:
            return 0, 0.0
        ahead = self.queue.position(rid)
        tokens_ahead = self.queue.queued_tokens_ahead(rid)
        # Ahead of it are `ahead` queued requests; it starts when they have all started
        # (one completion frees one seat), so the wait is ahead+1 completions away when
        # the engine is full.
        busy = self.capacity.seats_full
        eta = self.estimator.estimate_wait_seconds(ahead + (1 if busy else 0), tokens_ahead)
        return ahead, eta

    def cancel(self, ticket: Ticket) -> bool:
        """The client went away while queued; True if it was still queued."""
        if not ticket.queued:
            return False
        self.queue.remove(ticket.request_id)
        self._close(ticket, 0, 0)
        return True

    def finished(self, ticket: Ticket, *, keep_reservation: bool = False) -> None:
        """The request ended (any way): release its admission.

        ``keep_reservation``: it stopped to continue elsewhere, where it is not charged
        again, so its reserved tokens stay spent instead of being reconciled.  (Engine
        capacity is released by the scheduler when it lets go of the sequence.)
        """
        request = ticket.request
        num_output_tokens = ticket.num_output_tokens
        completed = ticket.was_dispatched and num_output_tokens > 0
        if keep_reservation:
            self._close(ticket, ticket.admitted.reserved_tokens, 0)
        else:
            self._close(ticket, request.num_prompt_tokens, num_output_tokens)
        if completed:
            self.estimator.record_completion(request.num_prompt_tokens + num_output_tokens)
        if ticket.was_dispatched:
            # Dispatch charged the worst case; give back what was not generated.
            unused = ticket.max_output_tokens - num_output_tokens
            if unused > 0:
                self.queue.record_served(ticket.tenant.name, -unused)

    def record_step(self, step_seconds: float) -> None:
        if self.breaker is not None:
            self.breaker.record_step(step_seconds)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def queued_by_class(self) -> dict[str, int]:
        return {pc.value: self.queue.num_queued(pc) for pc in PriorityClass}

    def retry_after_seconds(self, priority_class: PriorityClass) -> float:
        """When a request of this class refused now should come back."""
        ahead = self.queue.num_queued(priority_class)
        if priority_class is PriorityClass.BATCH:
            ahead += self.queue.num_queued(PriorityClass.INTERACTIVE)
        return self.estimator.retry_after_seconds(ahead, self.queue.num_queued_tokens())

    def count_rejection(self, rejection: Rejection) -> None:
        self.metrics.rejections_total.labels(rejection.reason.value).inc()

    # -------------------------------------------------------------- internals
    def _close(self, ticket: Ticket, prompt_tokens: int, output_tokens: int) -> None:
        if ticket.state is TicketState.CLOSED:
            return
        ticket.state = TicketState.CLOSED
        ticket.admitted.release(prompt_tokens, output_tokens)

    def _refuse(self, item: QueueItem, why: str) -> None:
        ticket = item.payload
        assert isinstance(ticket, Ticket)
        retry_after = self.retry_after_seconds(ticket.priority_class)
        rejection = (
            queue_timeout_rejection(
                time.monotonic() - ticket.enqueued_at, self.max_queue_wait_seconds, retry_after
            )
            if why == "timeout"
            else Rejection(
                RejectReason.QUEUE_FULL,
                503,
                f"The request was dropped from the queue ({why}). Retry after "
                f"{int(retry_after) + 1}s.",
                retry_after,
            )
        )
        self._refuse_with(ticket, rejection)

    def _refuse_with(self, ticket: Ticket, rejection: Rejection) -> None:
        self.count_rejection(rejection)
        ticket.rejection = rejection
        self._close(ticket, 0, 0)
        self._on_refused(ticket)

    async def _dispatch_loop(self) -> None:
        while True:
            # Queued requests expire, and their objectives become unreachable, with time:
            # looked at every tick.  With none queued only an event can change anything
            # (an idle server does not wake up).
            tick = _TICK_SECONDS if len(self.queue) else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            for expired in self.queue.expire(now, self.max_queue_wait_seconds):
                self._refuse(expired, "timeout")
            self._refuse_past_deadlines(now)
            self._pump(now)
            self._refuse_unreachable(now)

    def _refuse_past_deadlines(self, now: float) -> None:
        """Refuse the queued requests whose stated deadline has passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            item = self.queue.get(request_id)
            if item is None:
                continue  # started, or gone
            self.queue.remove(request_id)
            ticket = item.payload
            assert isinstance(ticket, Ticket)
            self._refuse_with(ticket, deadline_rejection(None, 0.0))

    def _pump(self, now: float) -> None:
        while (item := self.queue.peek_next()) is not None:
            ticket = item.payload
            assert isinstance(ticket, Ticket)
            if ticket.priority_class is PriorityClass.BATCH and (
                self.capacity.num_free_seats <= batch_headroom(self.capacity.seat_limit)
            ):
                break  # the last seats wait for interactive work that may come
            if not self.capacity.try_reserve_all(ticket.requests):
                break  # the engine is full: the queue waits, in order
            self.queue.pop_next()
            self._dispatch(ticket, now)

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        ticket.state = TicketState.DISPATCHED
        ticket.dispatched_at = now
        if self.slo is not None and ticket.predicted_wait_seconds is not None:
            self.slo.predictor.observe_wait(ticket.predicted_wait_seconds, now - ticket.enqueued_at)
        if self.breaker is not None:
            self.breaker.record_queue_wait(now - ticket.enqueued_at)
        # Charged at dispatch (prompt + max_tokens), refunded at the end: a tenant's share
        # counts from the moment its work takes engine capacity, not when it finishes.
        self.queue.record_served(ticket.tenant.name, ticket.max_total_tokens)
        self._submit(ticket)


def batch_headroom(seat_limit: int) -> int:
    """Seats that ``batch``-class work leaves free even when nothing else waits: a quarter
    (none below four seats).  Without it a large batch holds every seat, and each
    interactive request that arrives waits for a batch request to finish first (measured
    with ``sluicegate bench batch``, docs/batch-api.md)."""
    return seat_limit // 4


def _request(item: QueueItem) -> Request:
    ticket = item.payload
    assert isinstance(ticket, Ticket)
    return ticket.request


def request_fingerprint(ticket: Ticket) -> bytes:
    """What recognises a refused client when it sends its request again: its tenant, its
    prompt and its output limit (a retry sends the same body)."""
    request = ticket.request
    digest = hashlib.blake2b(digest_size=16)
    digest.update(ticket.tenant.name.encode())
    digest.update(b"\0%d\0%d\0" % (request.sampling.max_tokens, len(ticket.requests)))
    digest.update(array("l", request.prompt_token_ids).tobytes())
    return digest.digest()
