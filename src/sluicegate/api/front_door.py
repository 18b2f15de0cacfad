"""The front door: authenticate, admit, queue, and dispatch to the engine as it frees.

A request passes, in order: authentication (401), the admission controller (draining,
circuit breaker, the tenant's request and token buckets, concurrency caps: 429/503 with
``Retry-After``), and the bounded fair queue (per class and tenant; overflow policy).
A dispatcher hands queued requests to the engine only while it has room (free sequence
slots and the request's worst-case KV footprint), so the engine's own waiting line stays
short and the queue in front of it is where waiting happens: bounded, fair, and able to
tell each client its position and expected wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sluicegate.admission.breaker import BreakerConfig, CircuitBreaker, Threshold
from sluicegate.admission.controller import (
    AdmissionConfig,
    AdmissionController,
    Admitted,
    BucketFactory,
)
from sluicegate.admission.decision import Rejection, RejectReason, queue_timeout_rejection
from sluicegate.admission.fair_queue import (
    FairQueue,
    FairQueueConfig,
    OfferStatus,
    QueueItem,
)
from sluicegate.admission.retry_after import ServiceRateEstimator
from sluicegate.admission.tenants import AuthError, Tenant, TenantRegistry
from sluicegate.config import Settings
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.scheduler.request import FinishReason, Request
from sluicegate.store.base import StoreUnavailable
from sluicegate.types import PriorityClass

logger = logging.getLogger(__name__)


def rejection_error(rejection: Rejection) -> APIError:
    """A :class:`Rejection` as the HTTP error the client sees."""
    return APIError(
        rejection.http_status,
        rejection.message,
        code=rejection.error_code,
        error_type=rejection.reason.value
        if rejection.http_status != 400
        else "invalid_request_error",
        headers=rejection.headers(),
    )


@dataclass(slots=True)
class Ticket:
    """One admitted request's place at the front door until it finishes."""

    request: Request
    stream: RequestStream
    tenant: Tenant
    priority_class: PriorityClass
    admitted: Admitted
    kv_tokens: int
    enqueued_at: float
    dispatched: bool = False
    dispatched_at: float | None = None
    done: bool = False
    #: Set when the front door refused it after queueing (dropped, expired).
    rejection: Rejection | None = None
    #: Flow control freed its KV for a long pause: it no longer holds engine capacity.
    parked: bool = False


class FrontDoor:
    """Admission, the fair queue and the dispatcher.  Owned by the event loop."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        submit: Callable[[Request, RequestStream], None],
        max_model_len: int,
        bucket_factory: BucketFactory | None = None,
    ) -> None:
        """``bucket_factory`` makes the tenants' rate-limit buckets: ``Store.bucket``, so
        that every replica sharing the store enforces the same limits."""
        self.settings = settings
        self.metrics = metrics
        self._submit = submit
        self.registry = TenantRegistry(settings.tenants)
        self.estimator = ServiceRateEstimator(
            max_retry_after_seconds=settings.max_retry_after_seconds
        )
        self.breaker = (
            CircuitBreaker(
                BreakerConfig(
                    queue_wait_shed_batch=_threshold(settings.breaker_queue_wait_shed_seconds),
                    queue_wait_open=_threshold(settings.breaker_queue_wait_open_seconds),
                    step_shed_batch=_threshold(settings.breaker_step_shed_seconds),
                    step_open=_threshold(settings.breaker_step_open_seconds),
                    min_dwell_seconds=settings.breaker_min_dwell_seconds,
                )
            )
            if settings.breaker
            else None
        )
        self.controller = AdmissionController(
            self.registry,
            AdmissionConfig(
                max_concurrent_requests=settings.max_concurrent_requests,
                open_max_in_flight=settings.max_num_seqs,
                max_retry_after_seconds=settings.max_retry_after_seconds,
            ),
            breaker=self.breaker,
            estimator=self.estimator,
            bucket_factory=bucket_factory,
        )
        self._space = asyncio.Event()
        self.queue = FairQueue(
            FairQueueConfig.uniform(
                settings.max_queued_requests,
                settings.max_queued_tokens,
                settings.queue_policy,
                batch_policy=settings.batch_queue_policy,
            ),
            weights={t.name: t.weight for t in self.registry.tenants},
            on_space_freed=self._space.set,
        )
        self.max_num_seqs = settings.max_num_seqs
        self.kv_capacity_tokens = settings.total_kv_blocks * settings.kv_block_size
        self.block_size = settings.kv_block_size
        self.max_model_len = max_model_len
        self._active: dict[str, Ticket] = {}  # dispatched, not finished
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._dispatch_loop(), name="sluicegate-dispatcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ------------------------------------------------------------- requests
    def authenticate(self, authorization: str | None) -> Tenant:
        try:
            return self.registry.authenticate(authorization)
        except AuthError as exc:
            self.metrics.rejections_total.labels("auth").inc()
            raise rejection_error(exc.to_rejection()) from None

    def priority_of(self, tenant: Tenant, requested: str | None) -> PriorityClass:
        return PriorityClass(requested) if requested else tenant.priority_class

    async def enter(
        self,
        tenant: Tenant,
        priority_class: PriorityClass,
        request: Request,
        stream: RequestStream,
        *,
        rate_limited: bool = True,
    ) -> Ticket:
        """Admit and queue a request, or raise the :class:`APIError` that refuses it.

        ``rate_limited=False``: a stream resumed here, already charged where it started.
        """
        try:
            admitted = await self.controller.admit_async(
                tenant, priority_class, request.num_prompt_tokens, request.sampling.max_tokens,
                rate_limited=rate_limited,
            )  # fmt: skip
        except StoreUnavailable as error:
            # store_failure_mode fail_closed: no shared limits, no admission.
            self.metrics.rejections_total.labels("store_unavailable").inc()
            raise APIError(
                503,
                f"The rate-limit store is unreachable, so limits cannot be checked ({error}). "
                "Retry shortly.",
                code="store_unavailable",
                headers={"retry-after": "1"},
            ) from None
        if isinstance(admitted, Rejection):
            self._count_rejection(admitted)
            raise rejection_error(admitted)
        request.priority = priority_class.rank
        ticket = Ticket(
            request=request,
            stream=stream,
            tenant=tenant,
            priority_class=priority_class,
            admitted=admitted,
            kv_tokens=self._kv_tokens(request.max_total_tokens),
            enqueued_at=time.monotonic(),
        )
        item = QueueItem(
            id=request.request_id,
            tenant=tenant.name,
            priority_class=priority_class,
            num_tokens=request.max_total_tokens,
            enqueued_at=ticket.enqueued_at,
            payload=ticket,
        )
        deadline = ticket.enqueued_at + self.settings.max_queue_wait_seconds
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
                        await asyncio.wait_for(self._space.wait(), remaining)
                    continue
                admitted.release(0, 0)
                rejection = queue_timeout_rejection(
                    time.monotonic() - ticket.enqueued_at,
                    self.settings.max_queue_wait_seconds,
                    self._retry_after(priority_class),
                )
                self._count_rejection(rejection)
                raise rejection_error(rejection)
            admitted.release(0, 0)
            rejection = result.to_rejection(self._retry_after(priority_class))
            if result.status is OfferStatus.SPILL:
                rejection.message += (
                    ' Submit batch work as a background job ("background": true) to have it '
                    "journaled instead."
                )
            self._count_rejection(rejection)
            raise rejection_error(rejection)
        for victim in result.evicted:
            self._drop(victim, "drop-oldest: a newer request took its place in the full queue")
        self._pump(time.monotonic())  # straight to the engine when it has room
        return ticket

    def position(self, ticket: Ticket) -> tuple[int, float]:
        """(0-based position, expected wait in seconds) of a queued request."""
        rid = ticket.request.request_id
        if rid not in self.queue:
            return 0, 0.0
        ahead = self.queue.position(rid)
        tokens_ahead = self.queue.queued_tokens_ahead(rid)
        # Ahead of it are `ahead` queued requests; it starts when they have all started
        # (one completion frees one slot), so the wait is ahead+1 completions away when
        # the engine is full.
        busy = len(self._active) >= self.max_num_seqs
        eta = self.estimator.estimate_wait_seconds(ahead + (1 if busy else 0), tokens_ahead)
        return ahead, eta

    def cancel(self, ticket: Ticket) -> bool:
        """The client went away while queued; True if it was still queued."""
        if ticket.dispatched or ticket.done:
            return False
        self.queue.remove(ticket.request.request_id)
        self._close(ticket, 0, 0)
        return True

    def finished(self, ticket: Ticket, *, keep_reservation: bool = False) -> None:
        """The request ended (any way): release its admission and engine capacity.

        ``keep_reservation``: it stopped to continue elsewhere, where it is not charged
        again, so its reserved tokens stay spent instead of being reconciled.
        """
        request = ticket.request
        completed = ticket.dispatched and request.num_output_tokens > 0
        if keep_reservation:
            self._close(ticket, ticket.admitted.reserved_tokens, 0)
        else:
            self._close(ticket, request.num_prompt_tokens, request.num_output_tokens)
        if completed:
            self.estimator.record_completion(request.num_tokens)
        if ticket.dispatched:
            # Dispatch charged the worst case; give back what was not generated.
            unused = request.sampling.max_tokens - request.num_output_tokens
            if unused > 0:
                self.queue.record_served(ticket.tenant.name, -unused)

    def set_parked(self, request_id: str, parked: bool) -> None:
        ticket = self._active.get(request_id)
        if ticket is not None and ticket.parked != parked:
            ticket.parked = parked
            self._wake.set()

    def record_step(self, step_seconds: float) -> None:
        if self.breaker is not None:
            self.breaker.record_step(step_seconds)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    def queued_by_class(self) -> dict[str, int]:
        return {pc.value: self.queue.num_queued(pc) for pc in PriorityClass}

    # -------------------------------------------------------------- internals
    def _kv_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.block_size

    def _retry_after(self, priority_class: PriorityClass) -> float:
        ahead = self.queue.num_queued(priority_class)
        if priority_class is PriorityClass.BATCH:
            ahead += self.queue.num_queued(PriorityClass.INTERACTIVE)
        return self.estimator.retry_after_seconds(ahead, self.queue.num_queued_tokens())

    def _count_rejection(self, rejection: Rejection) -> None:
        self.metrics.rejections_total.labels(rejection.reason.value).inc()

    def _close(self, ticket: Ticket, prompt_tokens: int, output_tokens: int) -> None:
        if ticket.done:
            return
        ticket.done = True
        rid = ticket.request.request_id
        self._active.pop(rid, None)
        ticket.admitted.release(prompt_tokens, output_tokens)
        self._wake.set()

    def _drop(self, item: QueueItem, why: str) -> None:
        ticket = item.payload
        assert isinstance(ticket, Ticket)
        rejection = (
            queue_timeout_rejection(
                time.monotonic() - ticket.enqueued_at,
                self.settings.max_queue_wait_seconds,
                self._retry_after(ticket.priority_class),
            )
            if why == "timeout"
            else Rejection(
                RejectReason.QUEUE_FULL,
                503,
                f"The request was dropped from the queue ({why}). Retry after "
                f"{int(self._retry_after(ticket.priority_class)) + 1}s.",
                self._retry_after(ticket.priority_class),
            )
        )
        self._count_rejection(rejection)
        ticket.rejection = rejection
        self._close(ticket, 0, 0)
        request = ticket.request
        ticket.stream.put(
            RequestOutput(
                request.request_id, "", 0, request.num_prompt_tokens, 0,
                FinishReason.ERROR, error=rejection.message,
            )
        )  # fmt: skip

    def _has_room(self, ticket: Ticket) -> bool:
        holding = [t for t in self._active.values() if not t.parked]
        if len(holding) >= self.max_num_seqs:
            return False
        kv_used = sum(t.kv_tokens for t in holding)
        return kv_used + ticket.kv_tokens <= self.kv_capacity_tokens

    async def _dispatch_loop(self) -> None:
        tick = 0.05
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            now = time.monotonic()
            for expired in self.queue.expire(now, self.settings.max_queue_wait_seconds):
                self._drop(expired, "timeout")
            self._pump(now)

    def _pump(self, now: float) -> None:
        while (item := self.queue.peek_next()) is not None:
            ticket = item.payload
            assert isinstance(ticket, Ticket)
            if not self._has_room(ticket):
                break  # the engine is full: the queue waits, in order
            self.queue.pop_next()
            self._dispatch(ticket, now)

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        ticket.dispatched = True
        ticket.dispatched_at = now
        rid = ticket.request.request_id
        self._active[rid] = ticket
        waited = now - ticket.enqueued_at
        if self.breaker is not None:
            self.breaker.record_queue_wait(waited)
        # Charged at dispatch (prompt + max_tokens), refunded at the end: a tenant's share
        # counts from the moment its work takes engine capacity, not when it finishes.
        self.queue.record_served(ticket.tenant.name, ticket.request.max_total_tokens)
        self._submit(ticket.request, ticket.stream)


def _threshold(enter_seconds: float) -> Threshold:
    return Threshold(enter_seconds, enter_seconds / 2)
