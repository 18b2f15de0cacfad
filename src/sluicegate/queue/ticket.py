"""One admitted request's place in line, from admission until it lets go of its capacity."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sluicegate.admission.controller import Admitted
from sluicegate.admission.decision import Rejection
from sluicegate.admission.request_objective import RequestObjective
from sluicegate.admission.tenants import Tenant
from sluicegate.scheduler.request import Request
from sluicegate.types import PriorityClass


class TicketState(enum.IntEnum):
    """Ordered: a ticket only moves forward."""

    #: Admitted, waiting in the fair queue.
    QUEUED = enum.auto()
    #: Handed to the scheduler.
    DISPATCHED = enum.auto()
    #: Its admission released (finished, cancelled, or refused after queueing).
    CLOSED = enum.auto()


@dataclass(slots=True)
class Ticket:
    """An admitted request as the queue sees it.  Owned by the dispatcher (event loop)."""

    request: Request
    tenant: Tenant
    priority_class: PriorityClass
    admitted: Admitted
    enqueued_at: float
    state: TicketState = TicketState.QUEUED
    dispatched_at: float | None = None
    #: Set when the queue refused it after admitting it (dropped, expired).
    rejection: Rejection | None = None
    #: At admission: its predicted wait for a seat and time to first token (None: not
    #: predicted, under static admission).
    predicted_wait_seconds: float | None = None
    predicted_ttft_seconds: float | None = None
    #: The learned margin included in ``predicted_ttft_seconds``.
    ttft_margin_seconds: float = 0.0
    #: The time to first token it was admitted to meet (its own objective, else its
    #: class's; None under static admission).
    ttft_objective_seconds: float | None = None
    #: The other choices' sequences of a request for ``n`` > 1 on the embedded core
    #: (``request`` is the first): dispatched together, each with a seat of its own.
    siblings: tuple[Request, ...] = ()
    #: A refused client back at its time: it takes the seat promised to it, ahead of
    #: new arrivals.
    booked: bool = False
    #: What the request stated for itself (its own TTFT objective, its deadline).
    objective: RequestObjective = field(default_factory=RequestObjective)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def requests(self) -> tuple[Request, ...]:
        """Every sequence it runs: one per choice."""
        return (self.request, *self.siblings)

    @property
    def max_total_tokens(self) -> int:
        """Worst-case KV tokens of all its sequences (what dispatch reserves)."""
        return sum(r.max_total_tokens for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def max_output_tokens(self) -> int:
        return sum(r.sampling.max_tokens for r in self.requests)

    @property
    def queued(self) -> bool:
        return self.state is TicketState.QUEUED

    @property
    def was_dispatched(self) -> bool:
        return self.dispatched_at is not None
