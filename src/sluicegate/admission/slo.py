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
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluicegate.admission.objectives import Objectives
from sluicegate.admission.promises import RETURN_PRIOR, PromiseBook
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
        #: When refused clients were told to come back, and how many do.
        self.promises = PromiseBook(promise_grace_seconds, return_prior)
        #: Measured over predicted queue wait (EWMA of the log ratio).
        self._log_ratio = 0.0
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

    def _lane_seconds(self, prompt_tokens: int) -> float:
        """A prompt's prefill in a line of prompts (serial prefill, a full batch decoding):
        as the cost model predicts it beside a full batch, or at the rate the engine has
        measured while prompts waited, if that is slower (a rate measured beside fewer
        streams than a full batch would book clients on more than a full batch leaves)."""
        estimate = self._estimate()
        seconds = estimate.prefill_seconds(prompt_tokens)
        rate = estimate.prefill_tokens_per_second
        threshold = estimate.long_prompt_tokens
        if rate is not None and (threshold is None or prompt_tokens <= threshold):
            # (Measured on the prompts that wait, most of them short: a long one's chunks
            # deep in it cost what the cost model says, not that.)
            seconds = max(seconds, prompt_tokens / rate)
        return seconds * self.correction

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
        seconds = stall
        if (left := prompt_left(request)) > 0 and not stall:
            seconds += self._estimate().prefill_seconds(left)
        return seconds * self.correction + self._output_seconds(request)

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
        self.promises.expire(now)
        own = self.promises.own(fingerprint, now)
        seats, starts, lane = self._seats(holders, queued_ahead, num_free_seats, prompt_tokens)
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
        elif estimate.serial_prefill:
            # Prefilled after the prompts ahead of it in its lane (:meth:`_seats`), at the
            # rate a line of prompts is prefilled when there is one.
            ttft = max(wait, lane) + (self._lane_seconds(prompt_tokens) if lane > 0 else prefill)
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
        promises = self.promises.held(self.promises.times(until=horizon, besides=own))
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
            # The prompts' line (serial prefill): its own prompt, then the promised ones'.
            lane = ttft - margin if estimate.serial_prefill else 0.0
            mean_prefill = self._lane_seconds(mean_prompt)
            for promised in promises:
                back = max(0.0, promised - now)
                begins = max(heapq.heappop(seats), back, lane)
                if begins - back > budget:
                    harms = True
                    break
                lane = self._seat_promised(
                    seats, begins, lane, mean_prefill, estimate.serial_prefill
                )
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
        self.promises.expire(now)
        own = self.promises.own(fingerprint, now)
        if own is not None:
            self.promises.claim(own)

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
        self.promises.expire(now)
        self._last_refusal = now
        self.promises.forget(fingerprint)  # refused again: its new promise replaces the old
        seats, _, lane = self._seats(holders, queued_ahead, num_free_seats, prompt_tokens)
        estimate = self._estimate()
        booking = estimate.booking_seat_limit or estimate.seat_limit
        if len(seats) > booking:
            # Booked on the fewest seats open lately (scheduler/seat_limit.py): the first
            # seats to free beyond those are not taken again.
            seats = sorted(seats)[len(seats) - booking :]
        mean_prefill = self._lane_seconds(int(estimate.mean_prompt_tokens))
        for promised in self.promises.held(self.promises.times(after=now)):
            begins = max(heapq.heappop(seats), promised - now, lane)
            lane = self._seat_promised(seats, begins, lane, mean_prefill, estimate.serial_prefill)
        slot = now + max(seats[0], lane)
        prefill = self.prefill_seconds(prompt_tokens)
        budget = max(0.0, objective_seconds - prefill - self.margin)
        last = self.promises.last(default=now)
        spacing = self.mean_service_seconds() / max(1, booking)
        come_back = max(slot - budget / 2.0, last + spacing, now + 0.05)
        behind = slot - now + prefill + self.margin
        if come_back > now + self.max_retry_after_seconds:
            # Too far to hold a seat for: told the longest wait, with no seat held (clients
            # refused now would otherwise all be booked at the cap, a herd).
            return Refusal(self.max_retry_after_seconds, behind, held=False)
        self.promises.book(come_back, fingerprint)
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
        self.promises.expire(self._clock())
        promises = self.promises
        return {
            "mean_service_seconds": round(self.mean_service_seconds(), 4),
            "wait_correction": round(self.correction, 3),
            "ttft_margin_seconds": round(self.margin, 4),
            "promised_seats": len(promises),
            "promises_claimed": promises.num_claimed,
            "promises_lapsed": promises.num_lapsed,
            "promise_return_rate": round(promises.return_rate, 3),
        }

    def _seats(
        self,
        holders: Sequence[Request],
        queued: Sequence[Request],
        num_free_seats: int,
        prompt_tokens: int | None = None,
    ) -> tuple[list[float], list[float], float]:
        """When each seat is next free (a min-heap) after the queued requests take theirs,
        when each of those starts (its prefill begins), and when the engine's prefill is
        free for a new prompt of ``prompt_tokens`` after theirs (0 unless prefill is
        serial: :attr:`ServiceEstimate.serial_prefill`).  A loaded stall-free engine
        prefills one prompt at a time, so prompts form a line of their own: a burst
        admitted into free seats, or promised them, starts at the rate it prefills."""
        # An engine that prefills the prompts it holds together stalls its streams until
        # they are all prefilled (llama.cpp's server decodes nothing while it does).
        estimate = self._estimate()
        left = sum(prompt_left(r) for r in holders) if estimate.shared_prefill else 0
        stall = estimate.prefill_seconds(left) if left else 0.0
        lane = 0.0
        if estimate.serial_prefill:
            seats = []
            for r in holders:  # in the order they were dispatched: the line's
                if (tokens := prompt_left(r)) > 0:
                    lane += self._lane_seconds(tokens)
                seats.append(lane * (tokens > 0) + self._output_seconds(r))
        else:
            seats = [self.remaining_seconds(r, stall) for r in holders]
        seats = seats + [0.0] * num_free_seats or [0.0]
        heapq.heapify(seats)
        own_lane = lane  # (a short prompt passes the long ones being prefilled: its lane)
        if estimate.serial_prefill and prompt_tokens is not None:
            backlog = sum(ahead_in_lane(r, prompt_tokens, estimate) for r in holders)
            own_lane = self._lane_seconds(backlog) if backlog else 0.0
        starts = []
        for request in queued:
            start = heapq.heappop(seats)
            if estimate.serial_prefill:
                start = max(start, lane)
                lane = start + self._lane_seconds(request.num_prompt_tokens)
                own_lane = lane
                heapq.heappush(seats, lane + self._output_seconds(request))
            else:
                heapq.heappush(seats, start + self.service_seconds(request))
            starts.append(start)
        return seats, starts, own_lane

    def _seat_promised(
        self, seats: list[float], begins: float, lane: float, prefill: float, serial: bool
    ) -> float:
        """A promised client takes a seat at ``begins`` (on ``seats``, until it frees); under
        ``serial`` prefill its prompt takes ``prefill`` of the line: when the line is free."""
        if not serial:
            heapq.heappush(seats, begins + self.mean_service_seconds())
            return lane
        lane = begins + prefill
        heapq.heappush(seats, lane + self._own_output_seconds())
        return lane

    def _alone(self, prompt_tokens: int, prefill: float, budget: float) -> float:
        """Its prompt served as fast as it can be on a busy engine: with nothing beside it,
        unless even then it would not be prefilled within ``budget`` (a long prompt:
        beside the streams decoding now, ``prefill``).  A prompt that only the streams
        beside it make late is refused, not let through as a long one (on an idle engine,
        fewer than two requests held, none queued, nobody refused lately, it is ``prefill``)."""
        own = self.prefill_seconds(prompt_tokens, 0)
        return prefill if own >= budget else own

    def _output_seconds(self, request: Request) -> float:
        """What a seat holder has left to decode (at least a token), in seconds."""
        estimate = self._estimate()
        produced = request.num_output_tokens
        tokens = expected_output(request, estimate, produced) - produced
        return max(1.0, tokens) * step_seconds(request, estimate) * self.correction

    def _own_output_seconds(self, request: Request | None = None) -> float:
        estimate = self._estimate()
        tokens = (
            estimate.mean_output_tokens
            if request is None
            else expected_output(request, estimate, produced=0)
        )
        return tokens * estimate.step_seconds * self.correction


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
