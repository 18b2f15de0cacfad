"""Idle sequences: paused for their reader or throttled by their pace.

An idle sequence lends its dispatch seat to queued work (so slow readers cannot hold
every seat) and is the first to give up its KV when room is needed; one whose KV was
freed while idle is *parked*, out of the waiting line until it is busy again, when it
returns to the line's front.  This ledger owns who is throttled and who is parked; the
scheduler asks it.
"""

from __future__ import annotations

from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.waiting import WaitingQueue
from sluicegate.types import Clock


def is_idle(request: Request) -> bool:
    """Paused for its reader or throttled by its pace: it lends its seat."""
    return request.pause.paused or request.pace.throttled


class IdleSequences:
    """Who is throttled and who is parked, and the seats they lend."""

    def __init__(self, capacity: DispatchCapacity, waiting: WaitingQueue, clock: Clock) -> None:
        self._capacity = capacity
        self._waiting = waiting
        self._clock = clock
        #: Idle sequences whose KV was freed: out of the waiting line until resumed (paused)
        #: or due (throttled).
        self.parked: dict[str, Request] = {}
        #: Throttled sequences (waiting for their pace), by id.
        self.throttled: dict[str, Request] = {}

    def pause(self, request: Request) -> bool:
        """Its reader is behind: it lends its seat (False: it was paused already)."""
        if not request.pause.begin(self._clock()):
            return False
        self.lend_seat(request)
        return True

    def resume(self, request: Request) -> float | None:
        """Its reader caught up: how long it was paused (None: it was not)."""
        paused_seconds = request.pause.end(self._clock())
        if paused_seconds is not None:
            self.lend_seat(request)
        return paused_seconds

    def set_throttled(self, request: Request, throttled: bool) -> None:
        if request.pace.throttled == throttled:
            return
        request.pace.throttled = throttled
        if throttled:
            self.throttled[request.request_id] = request
        else:
            del self.throttled[request.request_id]
        self.lend_seat(request)

    def release_paced(self) -> int:
        """Take back the seats of throttled sequences whose pace allows a token now (a
        parked one returns to the front of the waiting line).  Returns how many."""
        if not self.throttled:
            return 0
        now = self._clock()
        due = [r for r in self.throttled.values() if now >= r.pace.next_token_time]
        for request in due:
            self.set_throttled(request, False)
        return len(due)

    def seconds_until_next_token(self) -> float | None:
        """Until a throttled sequence's next token is due (None: none is throttled)."""
        if not self.throttled:
            return None
        next_token = min(r.pace.next_token_time for r in self.throttled.values())
        return max(0.0, next_token - self._clock())

    def lend_seat(self, request: Request) -> None:
        """An idle sequence lends its dispatch seat; once it is busy again it takes it back,
        and if its KV was freed meanwhile it returns to the front of the waiting line."""
        idle = is_idle(request)
        self._capacity.set_idle(request.request_id, idle)
        if not idle:
            parked = self.parked.pop(request.request_id, None)
            if parked is not None:
                self._waiting.push(parked, front=True)

    def victim(self, running: list[Request]) -> Request | None:
        """The running sequence to give up its KV first: the newest paused one, else the
        throttled one whose next token is furthest away."""
        paused = next((r for r in reversed(running) if r.pause.paused), None)
        if paused is not None:
            return paused
        throttled = [r for r in running if r.pace.throttled]
        return max(throttled, key=lambda r: r.pace.next_token_time) if throttled else None

    def preempted(self, request: Request) -> None:
        """Its KV was freed: parked if idle, else back at the front of the waiting line."""
        if is_idle(request):
            self.parked[request.request_id] = request
        else:
            self._waiting.push(request, front=True)

    def finished(self, request: Request) -> None:
        request.pause.end(self._clock())
        request.pace.throttled = request.pace.yielding = False
        self.throttled.pop(request.request_id, None)
        self.parked.pop(request.request_id, None)
