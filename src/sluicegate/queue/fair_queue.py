"""The bounded, multi-class, weighted-fair admission queue in front of the scheduler.

* **Classes.** ``interactive`` is always served before ``batch``.  Each class is bounded
  by requests and by tokens (prompt + ``max_tokens``); optional global bounds cover both.
* **Overflow.** When an item does not fit, its class's policy decides: ``reject`` (429),
  ``block`` (the caller waits for space, up to its deadline, and offers again),
  ``drop-oldest`` (the oldest items of the same class make room and are returned so the
  caller can fail them), ``spill-to-disk`` (the caller hands the job to the journal).
* **Fairness within a class** follows the Virtual Token Counter of Sheng et al., "Fairness
  in Serving Large Language Models" (OSDI 2024): each tenant has a counter of
  ``served_tokens / weight``; the active tenant with the lowest counter goes next.  A
  tenant that becomes active is lifted to the lowest counter among the class's active
  tenants (or, in an empty class, to the counter of the tenant served last), so being
  idle banks no credit.  Counters only move by :meth:`FairQueue.record_served`: call it
  with the prompt tokens when an item is handed to the scheduler and with output tokens
  as they are produced.

Not thread-safe: the event loop owns it.  Every operation is O(1) apart from
:meth:`pop_next` (O(active tenants in the class)) and the position estimates (O(items in
the class)).
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sluicegate.admission.decision import Rejection, RejectReason, queue_full_rejection
from sluicegate.types import PriorityClass

_CLASS_ORDER = (PriorityClass.INTERACTIVE, PriorityClass.BATCH)


class OverflowPolicy(enum.StrEnum):
    """What happens to an item that does not fit (``--queue-policy``)."""

    REJECT = "reject"
    BLOCK = "block"
    DROP_OLDEST = "drop-oldest"
    SPILL_TO_DISK = "spill-to-disk"


@dataclass(slots=True, frozen=True)
class ClassLimits:
    """Bounds and overflow policy of one class (``None``: unbounded)."""

    max_queued_requests: int | None = 256
    max_queued_tokens: int | None = None
    policy: OverflowPolicy = OverflowPolicy.REJECT


@dataclass(slots=True, frozen=True)
class FairQueueConfig:
    """Per-class limits plus optional global limits over both classes."""

    interactive: ClassLimits = ClassLimits()
    batch: ClassLimits = ClassLimits()
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None

    @classmethod
    def uniform(
        cls,
        max_queued_requests: int | None,
        max_queued_tokens: int | None = None,
        policy: OverflowPolicy | str = OverflowPolicy.REJECT,
        *,
        batch_policy: OverflowPolicy | str | None = None,
        total_max_queued_requests: int | None = None,
        total_max_queued_tokens: int | None = None,
    ) -> FairQueueConfig:
        """Both classes with the same bounds (the shape of the CLI flags)."""
        interactive = ClassLimits(max_queued_requests, max_queued_tokens, OverflowPolicy(policy))
        batch = ClassLimits(
            max_queued_requests, max_queued_tokens, OverflowPolicy(batch_policy or policy)
        )
        return cls(interactive, batch, total_max_queued_requests, total_max_queued_tokens)

    def limits(self, priority_class: PriorityClass) -> ClassLimits:
        return self.interactive if priority_class is PriorityClass.INTERACTIVE else self.batch


@dataclass(slots=True)
class QueueItem:
    """One queued request.  ``num_tokens`` is prompt + ``max_tokens`` (its worst case)."""

    id: str
    tenant: str
    priority_class: PriorityClass
    num_tokens: int
    enqueued_at: float
    payload: object = None


class OfferStatus(enum.StrEnum):
    ADMITTED = "admitted"
    #: Full and the class policy is ``reject`` (or the item can never fit).
    REJECTED = "rejected"
    #: Full and the class policy is ``block``: wait for space, then offer again.
    MUST_WAIT = "must_wait"
    #: Full and the class policy is ``spill-to-disk``: journal the job instead.
    SPILL = "spill"


@dataclass(slots=True)
class OfferResult:
    """The outcome of :meth:`FairQueue.offer`.

    ``evicted`` holds the items dropped to make room (``drop-oldest``); the caller must
    fail them (they are no longer queued).  ``detail`` names the limit that was hit, for
    the client's message.  ``never_fits`` means the item alone exceeds a token bound.
    """

    status: OfferStatus
    evicted: tuple[QueueItem, ...] = ()
    detail: str = ""
    never_fits: bool = False

    @property
    def admitted(self) -> bool:
        return self.status is OfferStatus.ADMITTED

    @property
    def reason(self) -> RejectReason | None:
        return None if self.status is OfferStatus.ADMITTED else RejectReason.QUEUE_FULL

    def to_rejection(self, retry_after_seconds: float) -> Rejection:
        """The client's answer when not admitted (or when the wait for space ran out).

        An item that can never fit gets a 400 without ``Retry-After``; otherwise 429
        ``queue_full`` with the given ``Retry-After`` (from the service-rate estimator).
        """
        if self.never_fits:
            return Rejection(
                RejectReason.QUEUE_FULL,
                400,
                f"Request too large for the queue: {self.detail}.",
                code="request_too_large",
            )
        return queue_full_rejection(self.detail, retry_after_seconds)


_STATUS_BY_POLICY = {
    OverflowPolicy.REJECT: OfferStatus.REJECTED,
    OverflowPolicy.BLOCK: OfferStatus.MUST_WAIT,
    OverflowPolicy.SPILL_TO_DISK: OfferStatus.SPILL,
}


@dataclass(slots=True)
class _ClassQueue:
    #: Every item of the class in arrival order (for drop-oldest and expiry).
    fifo: OrderedDict[str, QueueItem] = field(default_factory=OrderedDict)
    #: Active tenants only (a tenant with no item here is removed), each FIFO.
    tenants: dict[str, OrderedDict[str, QueueItem]] = field(default_factory=dict)
    num_tokens: int = 0
    #: Counter of the tenant popped last: the lift floor when the class runs empty.
    last_virtual_tokens: float = 0.0


class FairQueue:
    """See the module docstring.

    ``on_space_freed`` is called (once per operation) whenever items leave the queue:
    the api layer sets the event its ``block``-policy waiters wait on.
    """

    def __init__(
        self,
        config: FairQueueConfig | None = None,
        weights: Mapping[str, float] | None = None,
        *,
        default_weight: float = 1.0,
        on_space_freed: Callable[[], None] | None = None,
    ) -> None:
        self.config = config or FairQueueConfig()
        self._weights: dict[str, float] = dict(weights or {})
        self._default_weight = default_weight
        self._on_space_freed = on_space_freed
        self._classes = {pc: _ClassQueue() for pc in _CLASS_ORDER}
        self._items: dict[str, QueueItem] = {}
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()
        self._num_tokens = 0
        self._virtual: dict[str, float] = {}

    # --- inspection ---

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def get(self, item_id: str) -> QueueItem | None:
        return self._items.get(item_id)

    def num_queued(self, priority_class: PriorityClass | None = None) -> int:
        if priority_class is None:
            return len(self._items)
        return len(self._classes[priority_class].fifo)

    def num_queued_tokens(self, priority_class: PriorityClass | None = None) -> int:
        if priority_class is None:
            return self._num_tokens
        return self._classes[priority_class].num_tokens

    def oldest_enqueued_at(self, priority_class: PriorityClass | None = None) -> float | None:
        """Arrival time of the oldest item (head-of-line age feeds the breaker)."""
        classes = _CLASS_ORDER if priority_class is None else (priority_class,)
        heads = [
            next(iter(self._classes[pc].fifo.values())).enqueued_at
            for pc in classes
            if self._classes[pc].fifo
        ]
        return min(heads) if heads else None

    def items(self, priority_class: PriorityClass) -> list[QueueItem]:
        """The class's queued items, oldest first."""
        return list(self._classes[priority_class].fifo.values())

    def virtual_tokens(self, tenant: str) -> float:
        """The tenant's counter: tokens served divided by its weight (after lifts)."""
        return self._virtual.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, self._default_weight)

    def set_weight(self, tenant: str, weight: float) -> None:
        if weight <= 0.0:
            raise ValueError(f"weight must be > 0; got {weight}")
        self._weights[tenant] = weight

    # --- the queue ---

    def offer(self, item: QueueItem) -> OfferResult:
        """Queue ``item`` if it fits, else apply its class's overflow policy."""
        if item.id in self._items:
            raise ValueError(f"item {item.id!r} is already queued")
        pc = item.priority_class
        limits = self.config.limits(pc)
        for cap, name in (
            (limits.max_queued_tokens, f"{pc.value} max_queued_tokens"),
            (self.config.max_queued_tokens, "total max_queued_tokens"),
        ):
            if cap is not None and item.num_tokens > cap:
                return OfferResult(
                    OfferStatus.REJECTED,
                    detail=f"the request's {item.num_tokens} tokens (prompt + max_tokens) "
                    f"exceed the {name} limit of {cap}; lower max_tokens or shorten the prompt",
                    never_fits=True,
                )
        blocked_by = self._limit_hit(pc, item.num_tokens, 0, 0)
        if blocked_by is None:
            self._insert(item)
            return OfferResult(OfferStatus.ADMITTED)
        policy = limits.policy
        if policy is OverflowPolicy.DROP_OLDEST:
            victims = self._victims_for(item)
            if victims is not None:
                for victim in victims:
                    self._remove(victim)
                self._insert(item)
                self._notify()
                return OfferResult(OfferStatus.ADMITTED, evicted=tuple(victims))
            return OfferResult(OfferStatus.REJECTED, detail=blocked_by)
        return OfferResult(_STATUS_BY_POLICY[policy], detail=blocked_by)

    def pop_next(self) -> QueueItem | None:
        """The next item to serve: highest class first, then the fairest tenant."""
        chosen = self._select()
        if chosen is None:
            return None
        best, virtual = chosen
        self._classes[best.priority_class].last_virtual_tokens = virtual
        self._remove(best)
        self._notify()
        return best

    def peek_next(self) -> QueueItem | None:
        """The item :meth:`pop_next` would return, left in the queue."""
        chosen = self._select()
        return None if chosen is None else chosen[0]

    def _select(self) -> tuple[QueueItem, float] | None:
        for pc in _CLASS_ORDER:
            cq = self._classes[pc]
            if not cq.tenants:
                continue
            best: QueueItem | None = None
            best_key = (0.0, 0)
            for tenant, items in cq.tenants.items():
                head = next(iter(items.values()))
                # Ties go to the earlier arrival, which keeps equal tenants alternating.
                key = (self._virtual.get(tenant, 0.0), self._seq[head.id])
                if best is None or key < best_key:
                    best, best_key = head, key
            assert best is not None
            return best, best_key[0]
        return None

    def remove(self, item_id: str) -> QueueItem | None:
        """Take an item out (its client went away); ``None`` if it is not queued."""
        item = self._items.get(item_id)
        if item is None:
            return None
        self._remove(item)
        self._notify()
        return item

    def expire(
        self, now: float, max_wait_seconds: float, priority_class: PriorityClass | None = None
    ) -> list[QueueItem]:
        """Remove and return every item that has waited longer than ``max_wait_seconds``.

        Scans each class from its oldest item and stops at the first that is in time, so
        it assumes ``enqueued_at`` grows in offer order (true with one monotonic clock).
        """
        expired: list[QueueItem] = []
        for pc in _CLASS_ORDER if priority_class is None else (priority_class,):
            fifo = self._classes[pc].fifo
            while fifo:
                oldest = next(iter(fifo.values()))
                if now - oldest.enqueued_at <= max_wait_seconds:
                    break
                self._remove(oldest)
                expired.append(oldest)
        if expired:
            self._notify()
        return expired

    def record_served(self, tenant: str, num_tokens: float) -> None:
        """Charge ``num_tokens`` of service to ``tenant``'s fair-share counter."""
        self._virtual[tenant] = self._virtual.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    # --- where an item stands ---

    def position(self, item_id: str) -> int:
        """0-based place of ``item_id`` in the order it would be served now.

        An estimate: it replays the fair-share order assuming no new arrivals and that
        each item, once popped, is charged exactly its ``num_tokens`` (prompt +
        ``max_tokens``, an upper bound) and nothing else.  Under those assumptions it is
        exact; in practice arrivals of a higher class, or other tenants, jump ahead and
        short answers move the line faster.  Raises ``KeyError`` for an item not queued.
        """
        return self._ahead(item_id)[0]

    def queued_tokens_ahead(self, item_id: str) -> int:
        """Tokens (prompt + ``max_tokens``) of the items :meth:`position` counts ahead."""
        return self._ahead(item_id)[1]

    def _ahead(self, item_id: str) -> tuple[int, int]:
        item = self._items.get(item_id)
        if item is None:
            raise KeyError(f"item {item_id!r} is not queued")
        num_ahead = 0
        tokens_ahead = 0
        # Higher classes go first, and serving them raises their tenants' counters.
        counters: dict[str, float] = {}
        for pc in _CLASS_ORDER:
            if pc is item.priority_class:
                break
            higher = self._classes[pc]
            num_ahead += len(higher.fifo)
            tokens_ahead += higher.num_tokens
            for tenant, items in higher.tenants.items():
                tokens = sum(i.num_tokens for i in items.values())
                counters[tenant] = counters.get(tenant, 0.0) + tokens / self.weight(tenant)
        cq = self._classes[item.priority_class]
        own_tokens_ahead = 0
        for other in cq.tenants[item.tenant].values():
            if other.id == item_id:
                break
            num_ahead += 1
            own_tokens_ahead += other.num_tokens
        tokens_ahead += own_tokens_ahead
        # The item's "virtual start": its tenant's counter once the items before it are served.
        start = (
            self.virtual_tokens(item.tenant)
            + counters.get(item.tenant, 0.0)
            + own_tokens_ahead / self.weight(item.tenant)
        )
        my_seq = self._seq[item_id]
        for tenant, items in cq.tenants.items():
            if tenant == item.tenant:
                continue
            counter = self.virtual_tokens(tenant) + counters.get(tenant, 0.0)
            weight = self.weight(tenant)
            for other in items.values():
                if counter > start or (counter == start and self._seq[other.id] > my_seq):
                    break
                num_ahead += 1
                tokens_ahead += other.num_tokens
                counter += other.num_tokens / weight
        return num_ahead, tokens_ahead

    # --- internals ---

    def _limit_hit(
        self, pc: PriorityClass, num_tokens: int, freed_requests: int, freed_tokens: int
    ) -> str | None:
        """The first bound that ``num_tokens`` more would break, after freeing some."""
        limits = self.config.limits(pc)
        cq = self._classes[pc]
        config = self.config
        checks = (
            (len(cq.fifo) - freed_requests + 1, limits.max_queued_requests, True, "requests"),
            (cq.num_tokens - freed_tokens + num_tokens, limits.max_queued_tokens, True, "tokens"),
            (len(self._items) - freed_requests + 1, config.max_queued_requests, False, "requests"),
            (
                self._num_tokens - freed_tokens + num_tokens,
                config.max_queued_tokens,
                False,
                "tokens",
            ),
        )
        for needed, cap, per_class, unit in checks:
            if cap is not None and needed > cap:
                scope = pc.value if per_class else "total"
                return f"{scope} max_queued_{unit} limit of {cap} reached"
        return None

    def _victims_for(self, item: QueueItem) -> list[QueueItem] | None:
        """Oldest items of the same class whose removal lets ``item`` fit, or ``None``."""
        victims: list[QueueItem] = []
        freed_tokens = 0
        for victim in self._classes[item.priority_class].fifo.values():
            victims.append(victim)
            freed_tokens += victim.num_tokens
            if (
                self._limit_hit(item.priority_class, item.num_tokens, len(victims), freed_tokens)
                is None
            ):
                return victims
        return None

    def _insert(self, item: QueueItem) -> None:
        cq = self._classes[item.priority_class]
        items = cq.tenants.get(item.tenant)
        if items is None:
            self._lift(item.tenant, cq)
            items = cq.tenants[item.tenant] = OrderedDict()
        items[item.id] = item
        cq.fifo[item.id] = item
        cq.num_tokens += item.num_tokens
        self._items[item.id] = item
        self._seq[item.id] = next(self._counter)
        self._num_tokens += item.num_tokens

    def _lift(self, tenant: str, cq: _ClassQueue) -> None:
        """A newly active tenant starts no lower than the others: idle time banks nothing."""
        if cq.tenants:
            floor = min(self._virtual.get(t, 0.0) for t in cq.tenants)
        else:
            floor = cq.last_virtual_tokens
        self._virtual[tenant] = max(self._virtual.get(tenant, 0.0), floor)

    def _remove(self, item: QueueItem) -> None:
        cq = self._classes[item.priority_class]
        del cq.fifo[item.id]
        items = cq.tenants[item.tenant]
        del items[item.id]
        if not items:
            del cq.tenants[item.tenant]
        cq.num_tokens -= item.num_tokens
        del self._items[item.id]
        del self._seq[item.id]
        self._num_tokens -= item.num_tokens

    def _notify(self) -> None:
        if self._on_space_freed is not None:
            self._on_space_freed()
