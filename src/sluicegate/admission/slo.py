"""Admission by latency objective: predict a request's time to first token, refuse it at
once when it would miss its objective, and say honestly when to come back.

**The prediction.** Seats free up as the sequences holding them finish: each holder's
remaining work (its output still to come, and its prefill if it has not started) at the
engine's predicted step time gives the time its seat frees.  The requests queued ahead
of a new one (its class and above, in order) take the seats as they free, each for its
own service time (prefill, then its expected output); the new request takes the next
seat, and its first token comes one prefill later.  It is a small event simulation over
the seats, with the scheduler's cost model as the clock of the engine.  Prompts admitted
just before it and still prefilling delay its first token too: the engine prefills them
first-come first-served.  Measured queue waits correct it: an exponentially weighted
ratio of measured to predicted waits stretches every predicted time.

**The answer when it would miss.** ``429 slo_unreachable`` with a ``Retry-After`` at which
a seat is *held* for it: the refusal books the seat that frees after everything queued
and promised, and the client is told to come back half its objective's budget before
that, so refused clients come back spread out, not as a herd.  Until they do, a new
arrival is admitted only if it would not push any promised client past its objective:
refused clients are served in the order they were refused (only clients due back while a
new request would hold its seat are protected from it, and a client back at its time is
not held back for those refused after it).  A returning client is recognised by its
request's fingerprint (its tenant, prompt and output limit: what a client that retries
sends again, as the OpenAI SDKs do at ``retry-after-ms``); a stranger never takes a
promised seat.  A client that comes back late loses its hold (it is then treated like
any new request), and a promise not claimed within ``promise_grace_seconds`` of its time
lapses.  Not every refused client comes back, so seats are held like an airline
overbooks: in proportion to the share of promises that were claimed lately, so that
clients who never return cannot keep seats idle.  A burst larger than the seats that
free within ``max_retry_after_seconds`` gets no promise: it is told the longest wait,
as overloaded.

Pure bookkeeping on a clock; the event loop owns it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sluicegate.admission.objectives import Objectives
from sluicegate.admission.work import (
    ahead_in_lane,
    expected_output,
    group_end,
    prefilling,
    prompt_left,
    step_seconds,
)
from sluicegate.scheduler.request import Request
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.types import Clock, PriorityClass


@dataclass(slots=True, frozen=True)
class Prediction:
    """When a request arriving now would start and see its first token."""

    wait_seconds: float
    ttft_seconds: float
    #: Admitting it would push a client promised a seat past its objective.
    harms_promised: bool = False
    #: Its TTFT on an engine with nothing else to prefill: its own prompt alone.
    alone_seconds: float = 0.0
    #: It is taken to be a refused client back at its time (a promise is due).
    claims_promise: bool = False
    #: The learned margin included in ``ttft_seconds`` (see :attr:`TTFTPredictor.margin`).
    margin_seconds: float = 0.0
    #: Clients promised a seat that admitting it would harm (0 when it harms none).
    num_promised: int = 0
    #: Prompts prefilled together with it that admitting it would make late (an engine
    #: that prefills its prompts together: admission/work.py).
    num_delayed: int = 0

    def misses(self, objective_seconds: float) -> bool:
        """Would admitting it now miss an objective?  (Its own is never missed when
        nothing is ahead of it: a prompt too long to prefill within the objective is
        served as fast as it can be, and may wait up to half its objective for a seat.)"""
        if self.alone_seconds >= objective_seconds:
            late = self.ttft_seconds - self.alone_seconds > 0.5 * objective_seconds
        else:
            late = self.ttft_seconds > objective_seconds
        return late or self.harms_promised or self.num_delayed > 0


@dataclass(slots=True, frozen=True)
class Refusal:
    """A refusal's answer: when to come back, and what it would have waited for."""

    retry_after_seconds: float
    #: Its predicted TTFT had it waited behind everything queued and promised.
    ttft_behind_seconds: float
    #: A seat is held for it (False: too far ahead, the server is overloaded).
    held: bool


#: Promises whose outcome (claimed or lapsed) sets the share of seats held, and the share
#: assumed before any: most clients retry (the OpenAI SDKs do, twice, at the time told),
#: and seats held for all would leave none for a newcomer while one refused client does
#: not come back.
_RETURN_WINDOW = 32
RETURN_PRIOR = 0.8

#: A refused client back at its time is admitted unless its predicted TTFT passes this
#: multiple of its objective (its seat was booked on a prediction), and a newcomer is
#: refused only if it would push a promised client past that.
LATE_TOLERANCE = 1.5

#: Fewer requests held than this, and none queued: a newcomer is admitted whatever is
#: promised (two clients at once on an idle server are never refused).
IDLE_BELOW = 2

#: An engine that refused anyone this recently is under load: a second client is not let
#: through as if it were idle (its prompt beside the streams decoding must meet its
#: objective).
QUIET_AFTER_REFUSAL_SECONDS = 10.0

#: A returning client may come back this much before its time and still claim its seat.
EARLY_SECONDS = 0.25

#: Recent TTFT errors kept, the fewest that set a margin, and the quantile it is.
_TTFT_ERROR_WINDOW = 200
_TTFT_ERROR_MIN = 20
_TTFT_ERROR_QUANTILE = 0.9


class TTFTPredictor:
    """Predicted TTFT at arrival, refusals with held seats, and its own error's correction."""

    def __init__(
        self,
        estimate: Callable[[], ServiceEstimate],
        clock: Clock,
        *,
        max_retry_after_seconds: float = 60.0,
        promise_grace_seconds: float = 1.5,
        return_prior: float = RETURN_PRIOR,
    ) -> None:
        self._estimate = estimate
        self._clock = clock
        self.max_retry_after_seconds = max_retry_after_seconds
        self.promise_grace_seconds = promise_grace_seconds
        #: When refused clients were told to come back, and their requests' fingerprints
        #: (a min-heap of (time, sequence, fingerprint)).
        self._promises: list[tuple[float, int, bytes | None]] = []
        self._sequence = itertools.count()
        #: Measured over predicted queue wait (EWMA of the log ratio).
        self._log_ratio = 0.0
        #: Whether each of the last promises due was claimed (seats are held in the share
        #: that was: :attr:`return_rate`).
        self._outcomes: deque[bool] = deque(maxlen=_RETURN_WINDOW)
        self._return_prior = return_prior
        #: Promises claimed by their clients, and lapsed unclaimed, since the start.
        self.num_claimed = 0
        self.num_lapsed = 0
        #: Measured minus predicted TTFT of recent admitted requests (before the margin).
        self._ttft_errors: deque[float] = deque(maxlen=_TTFT_ERROR_WINDOW)
        self._last_refusal = -math.inf

    # --- the engine's work, in seconds ---

    @property
    def correction(self) -> float:
        """How much longer than predicted queue waits have turned out (1: as predicted)."""
        return math.exp(self._log_ratio)

    @property
    def margin(self) -> float:
        """Seconds added to every predicted TTFT: the 90th percentile of recent errors
        (measured minus predicted), what the model of the engine does not see (the phase
        of its steps, an upstream's own scheduling, the relay).  0 until there are enough
        of them, and never negative: predictions that err early only cost goodput, which
        the wait correction already recovers."""
        if len(self._ttft_errors) < _TTFT_ERROR_MIN:
            return 0.0
        ordered = sorted(self._ttft_errors)
        return max(0.0, ordered[int(_TTFT_ERROR_QUANTILE * (len(ordered) - 1))])

    def prefill_seconds(self, prompt_tokens: int, num_decoding: int | None = None) -> float:
        """Its prompt's prefill beside ``num_decoding`` streams (default: a full batch)."""
        return self._estimate().prefill_seconds(prompt_tokens, num_decoding) * self.correction

    def service_seconds(self, request: Request) -> float:
        """A queued request's time in a seat: its prefill, then its expected output."""
        estimate = self._estimate()
        tokens = expected_output(request, estimate, produced=0)
        return (
            estimate.prefill_seconds(request.num_prompt_tokens)
            + tokens * step_seconds(request, estimate)
        ) * self.correction

    def remaining_seconds(self, request: Request, stall: float = 0.0) -> float:
        """Until a seat holder lets go: what is left of its prefill and expected output.
        ``stall``: the seconds for which the engine prefills the prompts it holds before
        any of its streams moves on (an engine that prefills them together), its own
        prompt's included."""
        estimate = self._estimate()
        seconds = stall
        left = prompt_left(request)
        if left > 0 and not stall:
            seconds += estimate.prefill_seconds(left)
        produced = request.num_output_tokens
        tokens = expected_output(request, estimate, produced) - produced
        seconds += max(1.0, tokens) * step_seconds(request, estimate)
        return seconds * self.correction

    def mean_service_seconds(self) -> float:
        return self._estimate().service_seconds * self.correction

    # --- predicting ---

    def predict(
        self,
        holders: Sequence[Request],
        queued_ahead: Sequence[Request],
        num_free_seats: int,
        prompt_tokens: int,
        objective_seconds: float,
        fingerprint: bytes | None = None,
        request: Request | None = None,
    ) -> Prediction:
        """A request arriving now: when it would start, and whether that harms a client
        promised a seat (a promise to this request's ``fingerprint`` whose time has come
        is its own: it claims it).  ``request``: the arrival itself, whose expected output
        is how long it would hold its seat (default: a typical answer's)."""
        now = self._clock()
        self._expire(now)
        own = self._own_promise(fingerprint, now)
        seats, starts = self._seats(holders, queued_ahead, num_free_seats)
        wait = seats[0]
        # Beside the streams decoding in their seats (none free: beside a full batch).
        decoding: int | None = None
        if num_free_seats > 0:
            decoding = sum(1 for r in holders if r.num_computed_tokens >= r.num_prompt_tokens)
        prefill = self.prefill_seconds(prompt_tokens, decoding)
        estimate = self._estimate()
        ttft = wait + prefill
        delayed = 0
        if estimate.shared_prefill:
            # Prefilled together with the prompts beside it (admission/work.py).
            members = prefilling(holders, queued_ahead, starts, now, objective_seconds)
            end, delayed = group_end(
                members, wait, prompt_tokens, lambda n: self.prefill_seconds(n, decoding)
            )
            ttft = max(ttft, end)
        elif backlog := sum(ahead_in_lane(r, prompt_tokens, estimate) for r in holders):
            # Prompts admitted just before it are still being prefilled: the engine shares
            # its token budget between them first-come first-served in their lane (a short
            # prompt goes ahead of long ones), so a burst of arrivals that all find a free
            # seat still wait for each other's prefill.
            ttft = max(ttft, self.prefill_seconds(backlog + prompt_tokens, decoding))
        margin = self.margin
        ttft += margin
        # Only clients yet to come back hold seats (a late one lost its hold), only those
        # due back while this request would be in its seat, and only in the share of
        # clients that do come back.
        held_for = self._own_output_seconds(request)
        horizon = now + wait + prefill + held_for
        # (A promise whose time has come is held through its grace: its client may be
        # on its way, up to a second late with a whole-second Retry-After.)
        promises = self._held(p[0] for p in self._promises if p[0] <= horizon and p != own)
        # A client whose promise has come is first in line among the promised (they are
        # served in the order they were refused): later promises do not hold it back.
        claims = own is not None
        harms = False
        # An engine holding fewer than two requests, with none queued, is idle enough
        # that a newcomer is never refused for promises: the seats promised are for
        # clients not back yet, and work it could start at once is not turned away.
        idle = len(holders) < IDLE_BELOW and not queued_ahead
        if promises and not claims and not idle:
            # Take the seat, then see that every promised client still starts in time: in
            # the time it is itself held to when back (the late tolerance).
            mean_prompt = int(self._estimate().mean_prompt_tokens)
            budget = max(
                0.0, LATE_TOLERANCE * objective_seconds - self.prefill_seconds(mean_prompt)
            )
            start = heapq.heappop(seats)
            heapq.heappush(seats, start + prefill + held_for)
            for promised in promises:
                back = max(0.0, promised - now)
                begins = max(heapq.heappop(seats), back)
                if begins - back > budget:
                    harms = True
                    break
                heapq.heappush(seats, begins + self.mean_service_seconds())
        quiet = idle and now - self._last_refusal > QUIET_AFTER_REFUSAL_SECONDS
        alone = (
            prefill if quiet else self._alone(prompt_tokens, prefill, objective_seconds - margin)
        )
        return Prediction(
            wait,
            ttft,
            harms,
            alone_seconds=alone + margin,
            claims_promise=claims,
            margin_seconds=margin,
            num_promised=len(promises) if harms else 0,
            num_delayed=0 if idle or claims else delayed,
        )

    def waits(
        self, holders: Sequence[Request], queued: Sequence[Request], num_free_seats: int
    ) -> list[float]:
        """The predicted wait of each queued request, in order."""
        return self._seats(holders, queued, num_free_seats)[1]

    # --- answering ---

    def admitted(self, fingerprint: bytes | None = None) -> None:
        """A request was admitted: if it was a refused client back at its time, its
        promise is used."""
        now = self._clock()
        self._expire(now)
        own = self._own_promise(fingerprint, now)
        if own is not None:
            self._promises.remove(own)
            heapq.heapify(self._promises)
            self._returned(True)

    def refuse(
        self,
        holders: Sequence[Request],
        queued_ahead: Sequence[Request],
        num_free_seats: int,
        objective_seconds: float,
        prompt_tokens: int,
        fingerprint: bytes | None = None,
    ) -> Refusal:
        """Book the seat that frees after everything queued and promised for the client
        of ``fingerprint``: the seconds until it should come back to take it within its
        objective (or the longest wait, with no seat held, when that is too far)."""
        now = self._clock()
        self._expire(now)
        self._last_refusal = now
        if fingerprint is not None:  # refused again: its new promise replaces the old
            self._promises = [p for p in self._promises if p[2] != fingerprint]
            heapq.heapify(self._promises)
        seats = self._seats(holders, queued_ahead, num_free_seats)[0]
        for promised in self._held(p[0] for p in self._promises if p[0] > now):
            begins = max(heapq.heappop(seats), promised - now)
            heapq.heappush(seats, begins + self.mean_service_seconds())
        slot = now + seats[0]
        prefill = self.prefill_seconds(prompt_tokens)
        budget = max(0.0, objective_seconds - prefill - self.margin)
        last = max((p[0] for p in self._promises), default=now)
        spacing = self.mean_service_seconds() / max(1, self._estimate().seat_limit)
        come_back = max(slot - budget / 2.0, last + spacing, now + 0.05)
        behind = slot - now + prefill + self.margin
        if come_back > now + self.max_retry_after_seconds:
            # Too far to hold a seat for: told the longest wait, with no seat held (clients
            # refused now would otherwise all be booked at the cap, a herd).
            return Refusal(self.max_retry_after_seconds, behind, held=False)
        heapq.heappush(self._promises, (come_back, next(self._sequence), fingerprint))
        return Refusal(come_back - now, behind, held=True)

    # --- learning ---

    def observe_wait(self, predicted_seconds: float, measured_seconds: float) -> None:
        """A request left the queue: how its wait compared with the prediction."""
        if predicted_seconds < 0.05 or measured_seconds <= 0.0:
            return  # started (almost) at once: says nothing about the rate
        ratio = min(4.0, max(0.25, measured_seconds / predicted_seconds * self.correction))
        self._log_ratio += 0.1 * (math.log(ratio) - self._log_ratio)

    def observe_ttft(self, predicted_seconds: float, measured_seconds: float) -> None:
        """An admitted request's first token: how it compared with the prediction made
        without the margin."""
        self._ttft_errors.append(measured_seconds - predicted_seconds)

    def snapshot(self) -> dict[str, float | int]:
        self._expire(self._clock())
        return {
            "mean_service_seconds": round(self.mean_service_seconds(), 4),
            "wait_correction": round(self.correction, 3),
            "ttft_margin_seconds": round(self.margin, 4),
            "promised_seats": len(self._promises),
            "promises_claimed": self.num_claimed,
            "promises_lapsed": self.num_lapsed,
            "promise_return_rate": round(self.return_rate, 3),
        }

    def _held(self, promised: Iterable[float]) -> list[float]:
        """The promises that hold a seat: in time order, ``return_rate`` of them, rounded
        (the first only while most refused clients come back: docs/admission.md)."""
        held: list[float] = []
        credit = 0.5
        for time in sorted(promised):
            credit += self.return_rate
            if credit >= 1.0 - 1e-9:
                credit -= 1.0
                held.append(time)
        return held

    def _own_promise(
        self, fingerprint: bytes | None, now: float
    ) -> tuple[float, int, bytes | None] | None:
        """The earliest promise to ``fingerprint`` whose time has come (or nearly: a
        client may be early by :data:`EARLY_SECONDS`), if any."""
        if fingerprint is None:
            return None
        due = [p for p in self._promises if p[2] == fingerprint and p[0] <= now + EARLY_SECONDS]
        return min(due, default=None)

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

    def _seats(
        self, holders: Sequence[Request], queued: Sequence[Request], num_free_seats: int
    ) -> tuple[list[float], list[float]]:
        """When each seat is next free (a min-heap) after the queued requests take theirs,
        and when each of those starts."""
        # An engine that prefills the prompts it holds together stalls its streams until
        # they are all prefilled (llama.cpp's server decodes nothing while it does).
        estimate = self._estimate()
        left = sum(prompt_left(r) for r in holders) if estimate.shared_prefill else 0
        stall = estimate.prefill_seconds(left) if left else 0.0
        seats = [self.remaining_seconds(r, stall) for r in holders]
        seats += [0.0] * num_free_seats
        if not seats:
            seats = [0.0]
        heapq.heapify(seats)
        starts = []
        for request in queued:
            start = heapq.heappop(seats)
            starts.append(start)
            heapq.heappush(seats, start + self.service_seconds(request))
        return seats, starts

    def _alone(self, prompt_tokens: int, prefill: float, budget: float) -> float:
        """Its prompt served as fast as it can be on a busy engine: with nothing beside it,
        unless even then it would not be prefilled within ``budget`` (a long prompt:
        beside the streams decoding now, ``prefill``).  A prompt that only the streams
        beside it make late is refused, not let through as a long one (on an idle engine,
        fewer than two requests held, none queued, nobody refused lately, it is ``prefill``)."""
        own = self.prefill_seconds(prompt_tokens, 0)
        return prefill if own >= budget else own

    def _own_output_seconds(self, request: Request | None = None) -> float:
        estimate = self._estimate()
        tokens = (
            estimate.mean_output_tokens
            if request is None
            else expected_output(request, estimate, produced=0)
        )
        return tokens * estimate.step_seconds * self.correction

    def _expire(self, now: float) -> None:
        while self._promises and self._promises[0][0] < now - self.promise_grace_seconds:
            heapq.heappop(self._promises)
            self._returned(False)


@dataclass(slots=True)
class SLOAdmission:
    """Admission by objective: the predictor and each class's objectives."""

    predictor: TTFTPredictor
    objectives: dict[PriorityClass, Objectives]
    #: Classes refused when they would miss their TTFT objective (batch work waits instead).
    enforced: frozenset[PriorityClass] = frozenset({PriorityClass.INTERACTIVE})
    #: A queued request is refused once its predicted TTFT passes this multiple of its
    #: objective (predictions err; a request close to its objective is still served), and
    #: so is a refused client back at its time (its seat was booked on a prediction too).
    late_tolerance: float = LATE_TOLERANCE

    def refuses(
        self,
        priority_class: PriorityClass,
        prediction: Prediction,
        stated_seconds: float | None = None,
    ) -> bool:
        """Is a new arrival of this class with this prediction refused?  A request that
        stated its own objective (``stated_seconds``) is held to it whatever its class."""
        if stated_seconds is None and priority_class not in self.enforced:
            return False
        class_seconds = self.objectives[priority_class].ttft_seconds
        objective = class_seconds if stated_seconds is None else stated_seconds
        if prediction.claims_promise:
            objective *= self.late_tolerance
        return prediction.misses(objective)
