"""Stall-free prefill: how many prompt tokens a step may take, and in what order.

*Stall-free batching* (after Sarathi-Serve): a step that carries decoding sequences takes
only the prefill tokens whose predicted cost keeps the step within those sequences' time
per output token objective (times a headroom), so a long prompt is prefilled in as many
chunks as that takes, interleaved with decode steps, and no running stream freezes
while it arrives.  The budget is the cost model's (a chunk's own cost and its
attention's query-key pairs included), so it follows the machine as the model is
refitted.  A step with no decoding sequence takes its whole token budget: no reader is
waiting on it.  One prefill a step always gets a floor (``min_chunk_tokens``, or the
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

from dataclasses import dataclass

from sluicegate.scheduler.cost_model import (
    StepCostModel,
    StepShape,
    chunk_seconds,
    chunk_tokens,
)
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


class StepTimeBudget:
    """The seconds a step has left for prefill after its decoders (None: no limit)."""

    def __init__(self, cost: StepCostModel, seconds_left: float | None, floor: int) -> None:
        self._coefficients = cost.coefficients
        self.seconds_left = seconds_left
        self._floor = floor
        self._given = False
        #: The time left gave a prompt fewer tokens than it could have taken.
        self.limited = False

    def tokens_for(self, start: int, wanted: int) -> int:
        """Prefill tokens for one prompt whose next position is ``start`` (at most
        ``wanted``): as many as the time left allows, the floor for the step's first."""
        if self.seconds_left is None or wanted <= 0:
            return max(0, wanted)
        fits = chunk_tokens(self._coefficients, start, self.seconds_left)
        if not self._given:
            fits = max(fits, self._floor)
        if fits < wanted:
            self.limited = True
        return max(0, min(wanted, fits))

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
        #: Steps whose prefill the time budget cut short (it had more to give).
        self.num_limited_steps = 0
        self._last_left: float | None = None

    # --- the budget ---

    def objective(self, priority: int) -> float | None:
        if priority_class(priority) == "interactive":
            return self.config.tpot_objective_seconds
        return self.config.batch_tpot_objective_seconds or self.config.tpot_objective_seconds

    def time_budget(
        self, decoders: list[Request], shape: StepShape, prefill_per_decode: float = 0.0
    ) -> StepTimeBudget:
        """What is left of the step for prefill, once ``decoders`` (of ``shape``) are in.

        The floor is ``min_chunk_tokens``, or the prompt tokens the seat limit counted on
        beside each decoded token (``prefill_per_decode``) when more: a full batch sized
        for its prompts' share still starts new answers at the rate it was sized for."""
        left: float | None = None
        objectives = [o for r in decoders if (o := self.objective(r.priority)) is not None]
        if self.config.stall_free and objectives and self.cost.calibrated:
            target = self.config.headroom * min(objectives)
            left = target - self.cost.predict(shape)
        self._last_left = left
        share = int(prefill_per_decode * len(decoders))
        return StepTimeBudget(self.cost, left, max(self.config.min_chunk_tokens, share))

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

    def order(self, candidates: list[PrefillCandidate], now: float) -> list[PrefillCandidate]:
        """Interactive before batch; within a class, short prompts and long ones passed
        over too long first, then long ones; then in line (:attr:`PrefillCandidate.rank`)."""
        patience = self.config.max_pass_over_seconds
        for c in candidates:
            c.lane = "long" if self.is_long(c.request, c.start) else "short"

        def key(c: PrefillCandidate) -> tuple[int, int, int]:
            since = c.request.prefill_passed_since
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
        for c in candidates:
            request = c.request
            tokens = given.get(request.request_id, 0)
            if tokens:
                self.lane_tokens[c.lane] += tokens
                self.phase_tokens["prefill"][priority_class(request.priority)] += tokens
                if not c.running:
                    self.lane_started[c.lane] += 1
                since = request.prefill_passed_since
                patience = self.config.max_pass_over_seconds
                if c.lane == "long" and since is not None and now - since >= patience:
                    self.num_promoted += 1
                request.prefill_passed_since = None
            elif given and c.lane == "long" and request.prefill_passed_since is None:
                request.prefill_passed_since = now
        for request, tokens in decoded:
            self.phase_tokens["decode"][priority_class(request.priority)] += tokens
        if budget.limited:
            self.num_limited_steps += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "stall_free": self.config.stall_free,
            "long_prompt_tokens": self.long_prompt_tokens(),
            "step_seconds_left_for_prefill": None
            if self._last_left is None
            else round(self._last_left, 4),
            "budget_limited_steps": self.num_limited_steps,
            "lanes": {
                lane: {"tokens": self.lane_tokens[lane], "started": self.lane_started[lane]}
                for lane in LANES
            },
            "long_promoted": self.num_promoted,
            "tokens_by_phase": {phase: dict(v) for phase, v in self.phase_tokens.items()},
        }
