"""How many sequences may decode at once: the largest batch that keeps TPOT under its
objective, from the cost model, corrected by the step times actually measured.

A sequence's time per output token is the engine's mean step time while it decodes.  A
step with ``n`` decoding sequences costs ``cost(n, n + prefill, context)``, where the
prefill share is the prompt tokens that new requests bring per decoded token (the typical
finished request's prompt over its answer).
The model limit is the largest ``n`` whose predicted step stays under ``headroom ×
objective``.  Then feedback, in the spirit of AIMD limiters (Netflix's
concurrency-limits, Envoy's adaptive concurrency): when the measured mean decode step
exceeds the objective, a correction factor shrinks multiplicatively (once per feedback
window, so that the next cut sees steps taken after this one); while it stays under the
model's target and the limit is reached, the factor grows back slowly.  Without an objective
the limit is the static ceiling.

Also the service estimate that admission predicts with: the start rate the engine
sustains at this limit, and how long a prompt takes to prefill.  Written on the engine
thread; the event loop reads only single numbers and the estimate, one immutable object
replaced whole (never a collection the engine thread is changing).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from sluicegate.scheduler.cost_model import (
    Coefficients,
    StepCostModel,
    StepShape,
    chunk_seconds,
    chunk_tokens,
)
from sluicegate.scheduler.prefill import first_prompt_tokens
from sluicegate.scheduler.prefill_rate import PrefillRate
from sluicegate.types import Clock

#: Refused clients are booked on the fewest seats open over this long: they come back up
#: to a minute later, and seats opened for a stretch of fast steps may be gone by then
#: (on a shared CPU the limit moves by half within seconds).
BOOKING_WINDOW_SECONDS = 30.0
#: ... and on no more than the engine has sustained within the objective over this long.
PROVEN_WINDOW_SECONDS = 120.0


@dataclass(slots=True, frozen=True)
class SeatLimitConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    #: Mean time per output token to keep under (None: the limit is ``max_num_seqs``).
    tpot_objective_seconds: float | None = None
    #: Aim the model at this fraction of the objective (prediction error, prefill spikes).
    headroom: float = 0.8
    update_interval_seconds: float = 0.5
    #: Measured steps that count for feedback.
    feedback_window_seconds: float = 3.0
    #: Prompt tokens a step always takes (stall-free prefill's floor).
    min_prefill_chunk_tokens: int = 4
    #: Never fewer seats than this (or ``max_num_seqs``): a second client arriving on an
    #: idle server is served beside the first, not refused for the TPOT objective (on a
    #: CPU a decode step of two costs about what a step of one does: it reads every
    #: weight once whatever the batch).
    min_seats: int = 2


class PrefillTargets(Protocol):
    """What stall-free prefill aims steps at, as the cost model counts (None: no limit),
    and where its long lane starts (:class:`~sluicegate.scheduler.prefill.PrefillPlanner`)."""

    #: Measured over predicted step time lately, beside decoders and without any.
    slowdown: float
    idle_slowdown: float
    #: The prefill rate measured while prompts waited (scheduler/prefill_rate.py).
    rate: PrefillRate

    def step_target_seconds(self) -> float | None: ...

    def step_objective_seconds(self) -> float | None: ...

    def idle_step_target_seconds(self) -> float | None: ...

    def long_prompt_tokens(self) -> int: ...


@dataclass(slots=True, frozen=True)
class ServiceEstimate:
    """What the engine sustains at the current limit (for admission's predictions)."""

    seat_limit: int
    #: Predicted mean step time with ``seat_limit`` sequences decoding.
    step_seconds: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    max_num_batched_tokens: int
    cost: Coefficients
    #: Stall-free prefill's step target beside decoders, and without any, and its floor.
    prefill_step_seconds: float | None = None
    idle_prefill_step_seconds: float | None = None
    #: The objective itself, which the seat limit's prompt share may use up to.
    prefill_objective_seconds: float | None = None
    #: Measured over predicted step time lately, beside decoders and without any.
    slowdown: float = 1.0
    idle_slowdown: float = 1.0
    min_prefill_chunk_tokens: int = 4
    #: Prompts with more tokens than this to prefill are long (prefilled after short
    #: ones); None: one lane.
    long_prompt_tokens: int | None = None
    #: Prompt tokens a second the engine has prefilled lately while prompts waited for it
    #: (None: not measured).
    prefill_tokens_per_second: float | None = None
    #: The fewest seats open lately: what refused clients are booked on (None: as many as
    #: now).
    booking_seat_limit: int | None = None
    #: The engine prefills the prompts it holds together, in an order of its own (an
    #: upstream engine): a prompt admitted later can delay an earlier one's first token.
    shared_prefill: bool = False

    def prefill_seconds(self, num_prompt_tokens: int, num_decoding: int | None = None) -> float:
        """Until a new request's first token: its prompt in chunks beside ``num_decoding``
        decoding sequences (default: a full batch but its own seat).  Under stall-free
        prefill a chunk is what the step's target leaves after the decoders (without
        decoders, what the idle target allows)."""
        decoding = max(0, self.seat_limit - 1) if num_decoding is None else num_decoding
        cost = self.cost
        decode = cost[0] + decoding * chunk_seconds(cost, int(self.mean_prompt_tokens), 1)
        budget = max(1, self.max_num_batched_tokens - decoding)
        target = self.prefill_step_seconds if decoding > 0 else self.idle_prefill_step_seconds
        slowdown = self.slowdown if decoding > 0 else self.idle_slowdown
        total = max(1, num_prompt_tokens)
        # Stretch by stretch (at most 16): under stall-free prefill a chunk is what the
        # step's target leaves after the decoders at the stretch's position (attention
        # makes a chunk dearer the further into the prompt it is).
        stretch = -(-total // 16)
        objective = self.prefill_objective_seconds if decoding > 0 else None
        # A prompt in a line is behind its first token's pace (scheduler/prefill.py): a
        # short one is prefilled in one step; a long one is cut in chunks of all that the
        # objective leaves beside the decoders (more than the seat limit's prompt share),
        # at least the scheduler's floor.
        threshold = self.long_prompt_tokens
        whole = threshold is not None and total <= threshold
        seconds = 0.0
        done = 0
        while done < total:
            chunk = budget
            if target is not None and not whole:
                to_objective = None if objective is None else objective - decode
                fits = first_prompt_tokens(
                    cost, done, target - decode, self.min_prefill_chunk_tokens
                )
                if to_objective is not None:
                    fits = max(fits, chunk_tokens(cost, done, to_objective))
                chunk = max(1, min(budget, fits))
            length = min(total - done, max(chunk, stretch))
            steps = -(-length // chunk)
            size = length / steps
            middle = done + int((length - size) / 2)
            seconds += steps * (decode + chunk_seconds(cost, middle, round(size))) * slowdown
            done += length
        return seconds

    @property
    def serial_prefill(self) -> bool:
        """The engine prefills its prompts one after another when loaded (stall-free
        prefill gives the time its decoders leave to the first prompt in line), not
        together and not each in its own seat's time."""
        return self.prefill_step_seconds is not None and not self.shared_prefill

    @property
    def service_seconds(self) -> float:
        """A typical request's time in a seat: its prefill, then its output."""
        return self.prefill_seconds(int(self.mean_prompt_tokens)) + (
            self.mean_output_tokens * self.step_seconds
        )

    @property
    def start_rate(self) -> float:
        """Requests per second that can start (seats free up at this rate when full)."""
        return self.seat_limit / max(self.service_seconds, 1e-6)


class SeatLimiter:
    """The seat limit and the service estimate, from the cost model and measured steps."""

    def __init__(
        self,
        config: SeatLimitConfig,
        cost: StepCostModel,
        clock: Clock,
        prefill: PrefillTargets | None = None,
    ) -> None:
        self.config = config
        #: Stall-free prefill's targets and lanes now (None: one budget a step, one lane).
        self._prefill = prefill
        self.cost = cost
        self._clock = clock
        self.limit = config.max_num_seqs
        self.model_limit = config.max_num_seqs
        self._mean_context = 256.0
        self._mean_prompt = 128.0
        self._mean_output = 64.0
        #: (time, limit) of the last ``BOOKING_WINDOW_SECONDS``' updates.
        self._limits: deque[tuple[float, int]] = deque()
        self.restart()
        self.estimate = self._estimate()

    def restart(self) -> None:
        """Forget the measured steps and the feedback drawn from them (at the start, and
        when the engine computes otherwise: see :meth:`Scheduler.engine_changed`); the
        next update sizes the limit from the cost model alone."""
        #: Feedback factor on the model limit, in [0.25, 1.5].
        self.correction: float = 1.0
        self._next_update: float = 0.0
        #: (time, seconds, decoding sequences) of recent steps with decodes, and their
        #: running sums, so that the event loop reads the mean without iterating a deque
        #: the engine thread is changing.
        self._decode_steps: deque[tuple[float, float, int]] = deque()
        self._weighted_seconds: float = 0.0
        self._decoding: int = 0
        #: No cut before this time: the measured window must first see the last cut.
        self._hold_until: float = 0.0
        #: (time, sequences decoding on average) of recent feedback windows whose steps
        #: met the objective: what the engine has shown it sustains.
        self._proven: deque[tuple[float, int]] = deque()

    # --- inputs (the engine thread) ---

    def on_step(self, shape: StepShape, num_decoding: int, seconds: float) -> None:
        """One step: ``num_decoding`` of its sequences decoded a token."""
        now = self._clock()
        if num_decoding:
            self._decode_steps.append((now, seconds, num_decoding))
            self._weighted_seconds += seconds * num_decoding
            self._decoding += num_decoding
            self._mean_context = _ewma(
                self._mean_context, shape.num_context_tokens / max(1, shape.num_seqs), 0.05
            )
        horizon = now - self.config.feedback_window_seconds
        while self._decode_steps and self._decode_steps[0][0] < horizon:
            _, old_seconds, old_decoding = self._decode_steps.popleft()
            self._weighted_seconds -= old_seconds * old_decoding
            self._decoding -= old_decoding
        if not self._decode_steps:
            self._weighted_seconds = 0.0  # no drift left behind by the subtractions

    def on_finished(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._mean_prompt = _ewma(self._mean_prompt, num_prompt_tokens, 0.05)
        self._mean_output = _ewma(self._mean_output, max(1, num_output_tokens), 0.05)

    def update(self, num_holding: int, num_waiting: int = 0) -> bool:
        """Recompute at most every ``update_interval_seconds``; True if the limit changed.

        ``num_holding``: sequences holding a seat now (is the limit what binds?);
        ``num_waiting``: of them, those whose prompt has not started.  The limit grows back
        only while seats are what binds: not while prompts wait for the engine's prefill
        (under stall-free prefill a step stays within its target by giving prompts less,
        so a short step is no sign of room, and more seats would only lengthen the line of
        prompts and their first tokens' wait).
        """
        now = self._clock()
        if now < self._next_update:
            return False
        self._next_update = now + self.config.update_interval_seconds
        before = self.limit
        objective = self.config.tpot_objective_seconds
        measured = self.measured_step_seconds()
        if objective is not None and self.cost.calibrated:
            self.model_limit = self._model_limit(objective * self.config.headroom)
            if measured is not None and measured > objective and now >= self._hold_until:
                # Cut, then wait for the window to fill with steps taken after the cut
                # (cutting again on the same slow steps would overshoot).
                self.correction = max(0.25, self.correction * 0.85)
                self._hold_until = now + self.config.feedback_window_seconds
            elif (
                measured is not None
                and measured < self.config.headroom * objective
                and num_holding >= self.limit
                and num_waiting == 0
            ):
                self.correction = min(1.5, self.correction * 1.05)
            target = math.floor(self.model_limit * self.correction)
            self.limit = max(self._floor, min(self.config.max_num_seqs, target))
        self._limits.append((now, self.limit))
        while self._limits and self._limits[0][0] < now - BOOKING_WINDOW_SECONDS:
            self._limits.popleft()
        if objective is not None and measured is not None and measured <= objective:
            # Sequences decoding at once, on average, within the objective: proven.
            decoding = int(self._decoding / max(1, len(self._decode_steps)))
            self._proven.append((now, decoding))
        while self._proven and self._proven[0][0] < now - PROVEN_WINDOW_SECONDS:
            self._proven.popleft()
        self.estimate = self._estimate()
        return self.limit != before

    # --- outputs ---

    @property
    def prefill_per_decode(self) -> float:
        """Prompt tokens prefilled per token decoded, in the steady state: while the seats
        are full, a request starts as one ends, so every answer's tokens are decoded beside
        one prompt (the typical finished request's prompt over its answer).  Not the
        recent steps' own share, which a burst of arrivals inflates for a moment: the
        objective is a request's mean over its life."""
        return self._mean_prompt / max(1.0, self._mean_output)

    @property
    def booking_limit(self) -> int:
        """The seats refused clients are booked on: the fewest open lately, and no more
        than the engine has shown it sustains within the objective lately (at least the
        floor): a promise is made on measured capacity, not on the cost model's word."""
        fewest = min((n for _, n in self._limits), default=self.limit)
        if self.config.tpot_objective_seconds is None:
            return fewest
        proven = max((n for _, n in self._proven), default=0)
        return max(self._floor, min(fewest, proven))

    @property
    def _floor(self) -> int:
        """The fewest seats ever open (``min_seats``, within ``max_num_seqs``)."""
        return max(1, min(self.config.min_seats, self.config.max_num_seqs))

    def measured_step_seconds(self) -> float | None:
        """Mean step time of recent steps with decodes, weighted by sequences decoding."""
        decoding = self._decoding
        if decoding <= 0:
            return None
        return max(0.0, self._weighted_seconds) / decoding

    def predicted_step_seconds(self, num_seqs: int) -> float:
        """Mean step time with ``num_seqs`` decoding and new prompts prefilled alongside."""
        prefill = num_seqs * self.prefill_per_decode
        tokens = num_seqs + min(prefill, self.config.max_num_batched_tokens)
        context = num_seqs * self._mean_context
        # Prompt chunks per step: a prompt's chunks over its answer's steps, at most one
        # a step (a full batch's typical prompt is short, and prefilled in one step when
        # it has to be: scheduler/prefill.py).
        chunk = self.config.max_num_batched_tokens
        chunks = min(1.0, num_seqs * math.ceil(self._mean_prompt / chunk) / self._mean_output)
        pairs = chunks * min(chunk, self._mean_prompt) * self._mean_prompt
        shape = StepShape(num_seqs, int(tokens), int(context))
        _, _, _, _, per_chunk, per_pair = self.cost.coefficients
        return self.cost.predict(shape) + per_chunk * chunks + per_pair * pairs

    def snapshot(self) -> dict[str, float | int | None]:
        return {
            "seat_limit": self.limit,
            "model_limit": self.model_limit,
            "correction": round(self.correction, 3),
            "tpot_objective_seconds": self.config.tpot_objective_seconds,
            "predicted_step_seconds": self.estimate.step_seconds,
            "measured_step_seconds": self.measured_step_seconds(),
            "mean_context_tokens": round(self._mean_context, 1),
            "prefill_tokens_per_decode": round(self.prefill_per_decode, 3),
            "mean_prompt_tokens": round(self._mean_prompt, 1),
            "mean_output_tokens": round(self._mean_output, 1),
            "start_rate_per_second": round(self.estimate.start_rate, 3),
            "booking_seat_limit": self.booking_limit,
        }

    def _model_limit(self, budget_seconds: float) -> int:
        best = 1
        for n in range(1, self.config.max_num_seqs + 1):
            if self.predicted_step_seconds(n) <= budget_seconds:
                best = n
        return best

    def _estimate(self) -> ServiceEstimate:
        prefill = self._prefill
        return ServiceEstimate(
            seat_limit=self.limit,
            booking_seat_limit=self.booking_limit,
            step_seconds=max(1e-4, self.predicted_step_seconds(self.limit)),
            mean_prompt_tokens=self._mean_prompt,
            mean_output_tokens=self._mean_output,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            cost=self.cost.coefficients,
            prefill_step_seconds=None if prefill is None else prefill.step_target_seconds(),
            prefill_objective_seconds=None if prefill is None else prefill.step_objective_seconds(),
            idle_prefill_step_seconds=None
            if prefill is None
            else prefill.idle_step_target_seconds(),
            slowdown=1.0 if prefill is None else prefill.slowdown,
            idle_slowdown=1.0 if prefill is None else prefill.idle_slowdown,
            min_prefill_chunk_tokens=self.config.min_prefill_chunk_tokens,
            long_prompt_tokens=None if prefill is None else prefill.long_prompt_tokens(),
            prefill_tokens_per_second=None if prefill is None else prefill.rate.tokens_per_second,
        )


def _ewma(current: float, value: float, alpha: float) -> float:
    return current + alpha * (value - current)
