"""Stall-free prefill: how many prompt tokens a step may take, and in what order.

*Stall-free batching* (after Sarathi-Serve): a step that carries decoding sequences takes
only the prefill tokens whose predicted cost keeps the step within those sequences' time
per output token objective (times a headroom), so a long prompt is prefilled in as many
chunks as that takes, interleaved with decode steps, and no running stream freezes
while it arrives.  The budget is the cost model's (a chunk's own cost and its
attention's query-key pairs included), so it follows the machine as the model is
refitted.  A step with no decoding sequence takes prompt tokens for up to
``long_prompt_seconds``: no reader is waiting on it, but a short prompt arriving meanwhile
waits for it to end.  One prefill a step always gets a floor (``min_chunk_tokens``, or the
prompt share the seat limit counted on, when more), so prompts progress even when the
decoders alone fill the step.

*Length-aware lanes*: a prompt is long when what it still has to prefill (after the
prefix cache) would take more than ``long_prompt_seconds`` alone at its position (or has
more than ``long_prompt_tokens`` tokens, when set): a short one is prefilled ahead of a
long one of the same priority, so a short question is not queued behind a pasted
document, and a long one lends its seat meanwhile (the scheduler tells the dispatch
capacity).  A long prompt passed over for ``max_pass_over_seconds`` goes ahead of the
short ones (no starvation).  Interactive prefill comes before batch prefill; decoding
sequences before either.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from sluicegate.scheduler.cost_model import (
    Coefficients,
    StepCostModel,
    StepShape,
    chunk_seconds,
    chunk_tokens,
)
from sluicegate.scheduler.prefill_rate import PrefillRate
from sluicegate.scheduler.prefix_cache import PrefixHit
from sluicegate.scheduler.request import Request

#: The lanes, by name (short first).
LANES = ("short", "long")
#: The scheduler's priorities, by class (``PriorityClass.rank``).
_CLASS_OF_PRIORITY = {0: "interactive"}


def priority_class(priority: int) -> str:
    """The admission class a scheduler priority stands for."""
    return _CLASS_OF_PRIORITY.get(priority, "batch")


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    #: Budget each step's prefill by the decoders' TPOT objective (False: every step takes
    #: its whole token budget, as before).
    stall_free: bool = True
    #: The TPOT objective of interactive decoders, and of batch ones (None: no budget).
    tpot_objective_seconds: float | None = None
    batch_tpot_objective_seconds: float | None = None
    #: Aim a step at this fraction of the tightest objective among its decoders.
    headroom: float = 0.8
    #: Prefill tokens a step always gives (to one prompt), whatever the budget (more when
    #: the seat limit counted on more: see :meth:`PrefillPlanner.time_budget`).
    min_chunk_tokens: int = 4
    #: A prompt with more tokens than this left to prefill is long (None: from the cost
    #: model, see ``long_prompt_seconds``).
    long_prompt_tokens: int | None = None
    #: With ``long_prompt_tokens`` unset: a prompt is long when what is left of it would
    #: take longer than this alone, at its position.
    long_prompt_seconds: float = 0.3
    #: A long prompt passed over this long goes ahead of short ones.
    max_pass_over_seconds: float = 2.0
    #: Steps run slower or faster than the cost model predicts in stretches (another
    #: process, the CPU's clock): each step's prediction is scaled by the recent steps'
    #: measured over predicted time, and what is left unpredicted is kept in bounds by
    #: aiming at ``1 / q`` of the objective when that is below ``headroom``, ``q`` this
    #: quantile of it over recent steps with decoders and a prompt chunk (0: neither).
    overrun_quantile: float = 0.98


#: The weight of each step in the recent slowdown (an exponential moving average: on a
#: shared CPU a slow step is followed by slow ones, measured lag-1 correlation 0.84).
SLOWDOWN_WEIGHT = 0.3
SLOWDOWN_RANGE = (0.8, 8.0)
#: A prompt whose first token is due is paced to be prefilled in this share of the time
#: left to it (the rest is slack: steps run longer than planned, and prompts ahead of it
#: in line take theirs).
PACE = 0.5
#: Steps of prompt chunks alone are few (a long prompt's while nothing decodes), and
#: what they miss is the fit's, not the machine's: each weighs more.
IDLE_SLOWDOWN_WEIGHT = 0.5
#: Steps with decoders and a prompt chunk remembered for their overrun, and the fewest
#: that set it.
OVERRUN_WINDOW = 256
MIN_OVERRUN_STEPS = 32
#: However far steps overrun, a step is aimed at no less than this fraction of the
#: objective (the floor still gives a prompt its tokens).
MIN_STEP_FRACTION = 0.5


def first_prompt_tokens(
    coefficients: Coefficients,
    start: int,
    seconds_left: float,
    floor: int,
    share: int = 0,
    seconds_to_objective: float | None = None,
) -> int:
    """The prompt tokens from ``start`` a step gives its first prompt: what fits in
    ``seconds_left``, at least ``floor``, and at least the seat limit's ``share`` while
    that fits in ``seconds_to_objective`` (the objective itself, beyond the headroom).
    The scheduler's rule (:class:`StepTimeBudget`) and admission's estimate of it
    (:meth:`~sluicegate.scheduler.seat_limit.ServiceEstimate.prefill_seconds`)."""
    fits = chunk_tokens(coefficients, start, seconds_left)
    if seconds_to_objective is not None:
        share = min(share, chunk_tokens(coefficients, start, seconds_to_objective))
    return max(fits, floor, share)


class StepTimeBudget:
    """The seconds a step has left for prefill after its decoders (None: no limit)."""

    def __init__(
        self,
        cost: StepCostModel,
        seconds_left: float | None,
        floor: int,
        share: int = 0,
        seconds_to_objective: float | None = None,
        objective_seconds: float | None = None,
    ) -> None:
        self._coefficients = cost.coefficients
        self.seconds_left = seconds_left
        self._floor = floor
        self._share = share
        self._to_objective = seconds_to_objective
        #: The decoders' TPOT objective itself (real seconds): the longest a step may take.
        self._objective = objective_seconds
        self._given = False
        #: The time left gave a prompt fewer tokens than it could have taken.
        self.limited = False
        #: The step's first prompt was given more for its first token's due time.
        self.hurried = False

    def tokens_for(
        self,
        start: int,
        wanted: int,
        seconds_to_due: float | None = None,
        *,
        short: bool = False,
    ) -> int:
        """Prefill tokens for one prompt whose next position is ``start`` (at most
        ``wanted``, the rest of its prompt): as many as the time left allows; the step's
        first prompt at least the floor, and the share while it keeps the step within the
        objective, and, when its first token is due in ``seconds_to_due``, what keeps it on
        time (:meth:`_on_time`; ``short``: the prompt is short)."""
        if self.seconds_left is None or wanted <= 0:
            return max(0, wanted)
        if self._given:
            fits = chunk_tokens(self._coefficients, start, self.seconds_left)
        else:
            fits = first_prompt_tokens(
                self._coefficients,
                start,
                self.seconds_left,
                self._floor,
                self._share,
                self._to_objective,
            )
            if (
                seconds_to_due is not None
                and (more := self._on_time(start, wanted, seconds_to_due, short)) > fits
            ):
                fits = more
                self.hurried = True
        if fits < wanted:
            self.limited = True
        return max(0, min(wanted, fits))

    def _on_time(self, start: int, wanted: int, seconds_to_due: float, short: bool) -> int:
        """The tokens a step gives a prompt with ``wanted`` left whose first token is due
        in ``seconds_to_due``.  On pace (at
        steps as long as the decoders' objective, the longest they may be, what keeps this
        step within it would prefill it in :data:`PACE` of the time left): the tokens that
        keep it on that pace.  Behind: a short prompt all of them, in this step (one step
        longer than the objective rather than a first token late: a short prompt's whole
        prefill takes at most ``long_prompt_seconds``); a long one all that keeps the step
        within the objective (it is served as fast as the streams beside it allow)."""
        if self._to_objective is None or self._objective is None:
            return 0
        most = chunk_tokens(self._coefficients, start, self._to_objective)
        steps = PACE * seconds_to_due / self._objective
        if most > 0 and steps >= 1.0 and math.ceil(wanted / most) <= steps:
            return min(most, math.ceil(wanted / steps))
        return wanted if short else most

    def spend(self, start: int, num_tokens: int) -> None:
        """A prompt took ``num_tokens`` from ``start``."""
        self._given = True
        if self.seconds_left is not None:
            self.seconds_left -= chunk_seconds(self._coefficients, start, num_tokens)


@dataclass(slots=True)
class PrefillCandidate:
    """A prompt with tokens to prefill: running (it holds a slot) or waiting."""

    request: Request
    #: Its next position to compute (a waiting one's prefix-cache hit, if any).
    start: int
    running: bool
    #: A waiting one's prefix-cache hit (where ``start`` comes from).
    hit: PrefixHit | None = None
    lane: str = "short"
    #: Its place in line: running ones first, then the waiting line's order (which is the
    #: fair queue's: the dispatcher hands requests over in the order it serves them).
    rank: int = 0


class PrefillPlanner:
    """Per step: the time left for prefill, and the order prompts take it in; and the
    counters of what each lane and class were given (``/v1/stats`` ``prefill``)."""

    def __init__(
        self, config: PrefillConfig, cost: StepCostModel, max_num_batched_tokens: int
    ) -> None:
        self.config = config
        self.cost = cost
        self.max_num_batched_tokens = max_num_batched_tokens
        #: Prefill tokens by lane; tokens scheduled by phase then class.
        self.lane_tokens = dict.fromkeys(LANES, 0)
        #: Prompts whose prefill began, by lane.
        self.lane_started = dict.fromkeys(LANES, 0)
        #: Long prompts sent ahead of short ones after being passed over.
        self.num_promoted = 0
        self.phase_tokens: dict[str, dict[str, int]] = {
            "decode": {"interactive": 0, "batch": 0},
            "prefill": {"interactive": 0, "batch": 0},
        }
        #: Since when each long prompt has been passed over for shorter ones (by id).
        self._passed_since: dict[str, float] = {}
        #: Steps whose prefill the time budget cut short (it had more to give).
        self.num_limited_steps = 0
        #: Steps that gave a prompt more for its first token's due time.
        self.num_hurried_steps = 0
        self._last_left: float | None = None
        self.restart()

    def restart(self) -> None:
        """Forget the measured slowdowns and prefill rate (at the start, and when the
        engine computes otherwise: see :meth:`Scheduler.engine_changed`)."""
        #: The engine's measured prefill rate when prompts wait (admission books by it).
        self.rate: PrefillRate = PrefillRate()
        self._limited_tokens: int | None = None
        #: Recent steps' measured over predicted time: steps with decoders, and steps of
        #: prompt chunks alone (big chunks deep in a prompt run slower than the fit of the
        #: small ones beside decoders says: their scores outgrow the caches).
        self.slowdown: float = 1.0
        self.idle_slowdown: float = 1.0
        #: What the slowdown left unpredicted in recent steps with a prompt chunk.
        self._overruns: deque[float] = deque(maxlen=OVERRUN_WINDOW)
        #: The fraction of the tightest TPOT objective a step with decoders is aimed at.
        self.step_fraction: float = self.config.headroom

    # --- the budget ---

    def observe(self, shape: StepShape, num_decoding: int, seconds: float) -> None:
        """A step ran in ``seconds`` (measured before the cost model learns from it, so
        against the prediction it was planned on).  With decoders, it moves the slowdown
        that scales the next such steps' predictions, and, with a prompt chunk, tells what
        that scaling missed, which sets :attr:`step_fraction`: the next steps are aimed
        so that all but ``1 - overrun_quantile`` of them stay within the objective (never
        above ``headroom``).  Prompt chunks alone move :attr:`idle_slowdown`."""
        if self._limited_tokens is not None and shape.num_chunks:
            self.rate.observe(self._limited_tokens, seconds)
        self._limited_tokens = None
        quantile = self.config.overrun_quantile
        if quantile <= 0 or not self.cost.calibrated:
            return
        predicted = self.cost.predict(shape)
        if predicted <= 0:
            return
        ratio = seconds / predicted
        low, high = SLOWDOWN_RANGE
        if not num_decoding:
            if shape.num_chunks:
                idle = self.idle_slowdown + IDLE_SLOWDOWN_WEIGHT * (ratio - self.idle_slowdown)
                self.idle_slowdown = min(high, max(low, idle))
            return
        if shape.num_chunks:
            self._overruns.append(ratio / self.slowdown)
            if len(self._overruns) >= MIN_OVERRUN_STEPS:
                ranked = sorted(self._overruns)
                overrun = ranked[min(len(ranked) - 1, int(quantile * len(ranked)))]
                fraction = min(self.config.headroom, 1.0 / max(overrun, 1e-6))
                self.step_fraction = max(MIN_STEP_FRACTION, fraction)
        slowdown = self.slowdown + SLOWDOWN_WEIGHT * (ratio - self.slowdown)
        self.slowdown = min(high, max(low, slowdown))

    def step_target_seconds(self) -> float | None:
        """What a step with interactive decoders is aimed at, as the cost model counts
        (None: no time budget)."""
        objective = self.config.tpot_objective_seconds
        if not self.config.stall_free or objective is None:
            return None
        return self._aim(objective)

    def step_objective_seconds(self) -> float | None:
        """The longest a step with interactive decoders may be, as the cost model counts:
        the TPOT objective, less what steps have overrun their prediction lately (the same
        share the target is lowered by), so that all but ``1 - overrun_quantile`` of the
        steps a prompt is given beyond the target stay within it (None: no budget)."""
        objective = self.config.tpot_objective_seconds
        if not self.config.stall_free or objective is None:
            return None
        return self._within(objective)

    def _aim(self, objective: float) -> float:
        """What a step beside decoders of ``objective`` is aimed at, as the cost model counts."""
        return self.step_fraction * objective / self.slowdown

    def _within(self, objective: float) -> float:
        """The longest such a step may be, as the cost model counts."""
        return self._aim(objective) / self.config.headroom

    def idle_step_target_seconds(self) -> float | None:
        """What a step without decoders is aimed at, as the cost model counts: no more
        than a short prompt's prefill (``long_prompt_seconds``), so a short prompt that
        arrives while a long one is prefilled alone waits at most about that long for
        the step under way (a chunk's own cost is a few percent of it)."""
        if not self.config.stall_free:
            return None
        return self.config.long_prompt_seconds / self.idle_slowdown

    def objective(self, priority: int) -> float | None:
        if priority_class(priority) == "interactive":
            return self.config.tpot_objective_seconds
        return self.config.batch_tpot_objective_seconds or self.config.tpot_objective_seconds

    def time_budget(
        self, decoders: list[Request], shape: StepShape, prefill_per_decode: float = 0.0
    ) -> StepTimeBudget:
        """What is left of the step for prefill, once ``decoders`` (of ``shape``) are in.

        The floor is ``min_chunk_tokens``; and the prompt tokens the seat limit counted on
        beside each decoded token (``prefill_per_decode``) are given while they keep the
        step within the objective itself (beyond the headroom): a full batch sized for its
        prompts' share still starts new answers at the rate it was sized for, but a share
        deep in a long prompt, where each token is dear, does not stretch the step past
        what its readers were promised."""
        left = to_objective = None
        objectives = [o for r in decoders if (o := self.objective(r.priority)) is not None]
        target = self.idle_step_target_seconds() if not decoders else None
        decoding = self.cost.predict(shape)
        tightest = min(objectives) if self.config.stall_free and objectives else None
        if tightest is not None:
            target = self._aim(tightest)
            to_objective = self._within(tightest) - decoding
        if target is not None and self.cost.calibrated:
            left = target - decoding
        self._last_left = left
        share = int(prefill_per_decode * len(decoders))
        return StepTimeBudget(
            self.cost,
            left,
            self.config.min_chunk_tokens,
            share,
            to_objective,
            tightest,
        )

    # --- the lanes ---

    def long_prompt_tokens(self) -> int:
        """Prompts with more tokens than this left to prefill are long."""
        if self.config.long_prompt_tokens is not None:
            return self.config.long_prompt_tokens
        if not self.cost.calibrated:
            return max(1, self.max_num_batched_tokens // 2)
        fixed = self.cost.coefficients[0]
        tokens = chunk_tokens(self.cost.coefficients, 0, self.config.long_prompt_seconds - fixed)
        return max(32, min(8192, tokens))

    def is_long(self, request: Request, start: int) -> bool:
        """Is what is left of its prompt from ``start`` long?  By the tokens left when
        ``long_prompt_tokens`` is set; else by their cost alone at that position (the tail
        of a long prompt is dear: its attention reads everything before it)."""
        left = request.num_tokens - start
        if left <= 1:
            return False  # its prompt is done: it decodes
        if self.config.long_prompt_tokens is not None or not self.cost.calibrated:
            return left > self.long_prompt_tokens()
        return chunk_seconds(self.cost.coefficients, start, left) > self.config.long_prompt_seconds

    def tokens_for(
        self, budget: StepTimeBudget, request: Request, start: int, wanted: int, now: float
    ) -> int:
        """The prompt tokens ``budget`` gives ``request`` from ``start`` (at most
        ``wanted``), paced by its first token's due time; a long prompt's tail is not a
        short prompt (it is not prefilled whole when late)."""
        due = request.pace.first_token_due
        if due is None:
            return budget.tokens_for(start, wanted)
        return budget.tokens_for(start, wanted, due - now, short=not self.is_long(request, 0))

    def order(self, candidates: list[PrefillCandidate], now: float) -> list[PrefillCandidate]:
        """Interactive before batch; within a class, short prompts and long ones passed
        over too long first, then long ones; then in line (:attr:`PrefillCandidate.rank`)."""
        patience = self.config.max_pass_over_seconds
        for c in candidates:
            c.lane = "long" if self.is_long(c.request, c.start) else "short"

        def key(c: PrefillCandidate) -> tuple[int, int, int]:
            since = self._passed_since.get(c.request.request_id)
            ahead = c.lane == "short" or (since is not None and now - since >= patience)
            return (c.request.priority, 0 if ahead else 1, c.rank)

        return sorted(candidates, key=key)

    def after_step(
        self,
        candidates: list[PrefillCandidate],
        given: dict[str, int],
        decoded: list[tuple[Request, int]],
        budget: StepTimeBudget,
        now: float,
    ) -> None:
        """Count what each prompt was given (``given``: tokens by request id) and each
        decoder computed, and mark long prompts passed over while others were served."""
        passed: dict[str, float] = {}
        for c in candidates:
            request = c.request
            since = self._passed_since.get(request.request_id)
            tokens = given.get(request.request_id, 0)
            if tokens:
                self.lane_tokens[c.lane] += tokens
                self.phase_tokens["prefill"][priority_class(request.priority)] += tokens
                if not c.running:
                    self.lane_started[c.lane] += 1
                patience = self.config.max_pass_over_seconds
                if c.lane == "long" and since is not None and now - since >= patience:
                    self.num_promoted += 1
            elif since is not None:
                passed[request.request_id] = since
            elif given and c.lane == "long":
                passed[request.request_id] = now
        # Only prompts still waiting for tokens are kept: one that finished, was aborted
        # or was served leaves no entry behind.
        self._passed_since = passed
        for request, tokens in decoded:
            self.phase_tokens["decode"][priority_class(request.priority)] += tokens
        if budget.limited:
            self.num_limited_steps += 1
        # The next observed step is this one: it counts for the rate if the budget cut it.
        self._limited_tokens = sum(given.values()) if budget.limited else None
        if budget.hurried:
            self.num_hurried_steps += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "stall_free": self.config.stall_free,
            "long_prompt_tokens": self.long_prompt_tokens(),
            "step_seconds_left_for_prefill": None
            if self._last_left is None
            else round(self._last_left, 4),
            "step_fraction_of_objective": round(self.step_fraction, 3),
            "slowdown": round(self.slowdown, 3),
            "idle_slowdown": round(self.idle_slowdown, 3),
            "budget_limited_steps": self.num_limited_steps,
            "hurried_steps": self.num_hurried_steps,
            "limited_tokens_per_second": None
            if self.rate.tokens_per_second is None
            else round(self.rate.tokens_per_second, 1),
            "lanes": {
                lane: {"tokens": self.lane_tokens[lane], "started": self.lane_started[lane]}
                for lane in LANES
            },
            "long_promoted": self.num_promoted,
            "long_passed_over": len(self._passed_since),
            "tokens_by_phase": {phase: dict(v) for phase, v in self.phase_tokens.items()},
        }
