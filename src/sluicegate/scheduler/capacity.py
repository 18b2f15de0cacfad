"""What more the engine can take on: sequence seats and KV tokens, as the scheduler sees it.

The dispatcher in front of the scheduler hands a request over only when it fits here,
so the scheduler's own waiting line stays short and waiting happens in the fair queue,
where it is bounded and can be told its position.  A request holds a seat and its
worst-case KV footprint (prompt + ``max_tokens``, in whole blocks) from the moment it is
dispatched until the scheduler lets go of it; while it is *idle* (paused for a slow
reader, or waiting for its pace) it holds neither, because the scheduler hands an idle
sequence's slot to waiting work.  The
number of seats follows the latency objective (:meth:`DispatchCapacity.set_seat_limit`,
from the scheduler's seat limiter), under the static ``max_num_seqs`` ceiling.

The scheduler (engine thread) is the one owner of these numbers: it marks requests
idle, busy again and finished.  The dispatcher (event loop) only asks and reserves.  A
lock keeps the two threads' views consistent; ``on_change`` tells the dispatcher that
room may have appeared (it is called on the engine thread, without the lock held).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluicegate.scheduler.request import Request


@dataclass(slots=True)
class _Holding:
    kv_tokens: int
    #: The request itself, when given: how far along it is tells when its seat frees.
    request: Request | None = None
    idle: bool = False
    #: Its long prompt is being prefilled: it lends its seat (not its KV) until its
    #: prompt is nearly done.
    prefilling: bool = False

    @property
    def holds_seat(self) -> bool:
        return not self.idle and not self.prefilling


class DispatchCapacity:
    """Seats and KV tokens held by dispatched requests.  Thread-safe."""

    def __init__(self, max_num_seqs: int, kv_capacity_tokens: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        #: Seats open now (the TPOT objective's limit; ``max_num_seqs`` without one).
        self.seat_limit = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        #: Called after a change that may let another request in (engine thread).
        self.on_change: Callable[[], None] | None = None
        #: Prompt tokens a request would find in the prefix cache now (None: no cache).
        self.cached_prefix: Callable[[Request], int] | None = None
        self._lock = threading.Lock()
        self._holding: dict[str, _Holding] = {}
        self._num_seats = 0
        self._kv_tokens = 0

    def kv_tokens_for(self, num_tokens: int) -> int:
        """``num_tokens`` rounded up to whole KV blocks."""
        return -(-num_tokens // self.block_size) * self.block_size

    def fits(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` (worst case) could be dispatched now."""
        kv = self.kv_tokens_for(num_tokens)
        with self._lock:
            return self._fits(kv)

    def try_reserve(self, request_id: str, num_tokens: int, request: Request | None = None) -> bool:
        """Reserve a seat and ``num_tokens`` of KV for a request about to be dispatched."""
        kv = self.kv_tokens_for(num_tokens)
        with self._lock:
            if request_id in self._holding or not self._fits(kv):
                return False
            self._holding[request_id] = _Holding(kv, request)
            self._num_seats += 1
            self._kv_tokens += kv
            return True

    def try_reserve_all(self, requests: Sequence[Request], *, booked: bool = False) -> bool:
        """Reserve a seat and the worst-case KV of each request, all or none: the choices
        of one answer (``n`` > 1) start together.  Choices that need more seats than are
        open now still start on an engine that holds nothing else (they can never fit
        otherwise), as long as ``max_num_seqs`` has room for them.  A ``booked`` request
        (a refused client back at the time its seat was promised) takes a seat above the
        seat limit too, within ``max_num_seqs``: the limit may have been cut since."""
        kv = [self.kv_tokens_for(r.max_total_tokens) for r in requests]
        with self._lock:
            if any(r.request_id in self._holding for r in requests):
                return False
            num_seats = self._num_seats + len(requests)
            alone = self._num_seats == 0 and self.seat_limit > 0
            seats = num_seats <= self.seat_limit or (
                (alone or booked) and num_seats <= self.max_num_seqs
            )
            if not seats or self._kv_tokens + sum(kv) > self.kv_capacity_tokens:
                return False
            for request, kv_tokens in zip(requests, kv, strict=True):
                self._holding[request.request_id] = _Holding(kv_tokens, request)
            self._num_seats = num_seats
            self._kv_tokens += sum(kv)
            return True

    @property
    def seats_full(self) -> bool:
        with self._lock:
            return self._num_seats >= self.seat_limit

    @property
    def num_free_seats(self) -> int:
        with self._lock:
            return max(0, self.seat_limit - self._num_seats)

    def holders(self) -> list[Request]:
        """The requests holding a seat now (those reserved with their request)."""
        with self._lock:
            return [
                h.request for h in self._holding.values() if h.request is not None and not h.idle
            ]

    def set_seat_limit(self, limit: int, floor: int = 1) -> None:
        """Open or close seats (at most ``max_num_seqs``, at least ``floor``: 0 only where
        the places are all taken by others, as other gateway replicas at an upstream); held
        seats are never taken back."""
        limit = max(floor, min(self.max_num_seqs, limit))
        with self._lock:
            grew = limit > self.seat_limit
            self.seat_limit = limit
        if grew:
            self._changed()

    @property
    def num_holding(self) -> int:
        """Requests holding a seat (dispatched, not idle, not finished)."""
        with self._lock:
            return self._num_seats

    def set_idle(self, request_id: str, idle: bool) -> None:
        """The scheduler found a request idle (paused, or waiting for its pace) or busy
        again: it lends out (or takes back) its seat and its KV.  Idempotent."""
        self._lend(request_id, "idle", idle, lends_kv=True)

    def set_prefilling(self, request_id: str, prefilling: bool) -> None:
        """A long prompt is being prefilled (or is nearly done): its request lends out (or
        takes back) its seat, so that short requests are not kept waiting for seats by
        prompts that decode nothing yet (length-aware lanes).  Idempotent."""
        self._lend(request_id, "prefilling", prefilling, lends_kv=False)

    def _lend(self, request_id: str, reason: str, lent: bool, *, lends_kv: bool) -> None:
        """Set one of a holding's reasons to lend its seat (``idle`` also lends its KV)."""
        with self._lock:
            holding = self._holding.get(request_id)
            if holding is None or getattr(holding, reason) == lent:
                return
            seat = holding.holds_seat
            setattr(holding, reason, lent)
            self._num_seats += holding.holds_seat - seat
            if lends_kv:
                self._kv_tokens += (-1 if lent else 1) * holding.kv_tokens
        if lent:
            self._changed()

    def release(self, request_id: str) -> None:
        """The scheduler let go of a request (finished, aborted, failed)."""
        with self._lock:
            holding = self._holding.pop(request_id, None)
            if holding is None:
                return
            self._num_seats -= holding.holds_seat
            if not holding.idle:
                self._kv_tokens -= holding.kv_tokens
        self._changed()

    def _fits(self, kv_tokens: int) -> bool:
        return (
            self._num_seats < self.seat_limit
            and self._kv_tokens + kv_tokens <= self.kv_capacity_tokens
        )

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
