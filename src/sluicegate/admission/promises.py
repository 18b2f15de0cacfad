"""The seats promised to refused clients: when each is due back, which of them hold a
seat, and how many come back.

A refusal under admission by objective books a seat for its client at the time it is
told to come back (admission/slo.py).  A returning client is recognised by its request's
fingerprint and may be up to :data:`EARLY_SECONDS` early; a promise not claimed within
the grace period after its time lapses.  Not every refused client comes back, so seats
are held like an airline overbooks: in proportion to the share of the last promises due
that were claimed (:attr:`PromiseBook.return_rate`).

Pure bookkeeping on times the caller gives; the event loop owns it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable

#: Promises whose outcome (claimed or lapsed) sets the share of seats held, and the share
#: assumed before any: most clients retry (the OpenAI SDKs do, twice, at the time told),
#: and seats held for all would leave none for a newcomer while one refused client does
#: not come back.
RETURN_WINDOW = 32
RETURN_PRIOR = 0.8

#: A returning client may come back this much before its time and still claim its seat.
EARLY_SECONDS = 0.25

#: One promise: (when its client is due back, a sequence number, its fingerprint).
Promise = tuple[float, int, bytes | None]


class PromiseBook:
    """Promised seats by time, and the share of them that were claimed lately."""

    def __init__(self, grace_seconds: float, return_prior: float = RETURN_PRIOR) -> None:
        self.grace_seconds = grace_seconds
        self._heap: list[Promise] = []
        self._sequence = itertools.count()
        #: Whether each of the last promises due was claimed.
        self._outcomes: deque[bool] = deque(maxlen=RETURN_WINDOW)
        self._return_prior = return_prior
        #: Promises claimed by their clients, and lapsed unclaimed, since the start.
        self.num_claimed = 0
        self.num_lapsed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def expire(self, now: float) -> None:
        """Promises past their time and grace lapse (their clients did not come back)."""
        while self._heap and self._heap[0][0] < now - self.grace_seconds:
            heapq.heappop(self._heap)
            self._returned(False)

    def own(self, fingerprint: bytes | None, now: float) -> Promise | None:
        """The earliest promise to ``fingerprint`` whose time has come (or nearly: a client
        may be early by :data:`EARLY_SECONDS`), if any."""
        if fingerprint is None:
            return None
        due = [p for p in self._heap if p[2] == fingerprint and p[0] <= now + EARLY_SECONDS]
        return min(due, default=None)

    def claim(self, promise: Promise) -> None:
        """Its client came back and was admitted: the promise is used."""
        self._heap.remove(promise)
        heapq.heapify(self._heap)
        self._returned(True)

    def book(self, time: float, fingerprint: bytes | None) -> None:
        """Promise a seat at ``time`` to the client of ``fingerprint`` (its earlier promise,
        if it was refused before, is :meth:`forget`-ten first: the new one is what it
        holds)."""
        heapq.heappush(self._heap, (time, next(self._sequence), fingerprint))

    def forget(self, fingerprint: bytes | None) -> None:
        """Drop the promises to ``fingerprint`` (its client was refused again)."""
        if fingerprint is None:
            return
        kept = [p for p in self._heap if p[2] != fingerprint]
        if len(kept) != len(self._heap):
            self._heap = kept
            heapq.heapify(self._heap)

    def times(
        self,
        *,
        after: float | None = None,
        until: float | None = None,
        besides: Promise | None = None,
    ) -> list[float]:
        """The promised times in ``(after, until]``, but ``besides``'s."""
        return [
            p[0]
            for p in self._heap
            if (after is None or p[0] > after) and (until is None or p[0] <= until) and p != besides
        ]

    def last(self, default: float) -> float:
        """The latest promised time (``default`` when none)."""
        return max((p[0] for p in self._heap), default=default)

    def held(self, promised: Iterable[float]) -> list[float]:
        """The promises that hold a seat: in time order, ``return_rate`` of them, rounded
        (the first only while most refused clients come back: docs/admission.md)."""
        held: list[float] = []
        credit = 0.5
        rate = self.return_rate
        for time in sorted(promised):
            credit += rate
            if credit >= 1.0 - 1e-9:
                credit -= 1.0
                held.append(time)
        return held

    @property
    def return_rate(self) -> float:
        """Share of the last promises due whose client came back, with a prior of
        :data:`RETURN_PRIOR` (as if that share of two had): at least 5%."""
        claimed = sum(self._outcomes)
        rate = (claimed + 2 * self._return_prior) / (len(self._outcomes) + 2)
        return max(0.05, rate)

    def _returned(self, came_back: bool) -> None:
        if came_back:
            self.num_claimed += 1
        else:
            self.num_lapsed += 1
        self._outcomes.append(came_back)
