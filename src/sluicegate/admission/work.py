"""A request's work as admission's predictor counts it: its expected output, its time per
output token, and the prompts it is prefilled behind or together with.

**Behind, or together.**  The embedded engine prefills first-come first-served within a
lane (a short prompt passes long ones): a prompt admitted later never delays an earlier
one's first token, and a newcomer waits for the prompt tokens ahead of it
(:func:`ahead_in_lane`).  An engine behind the gateway does not promise that: llama.cpp's
server fills its next batches with every prompt its slots hold, in slot order rather than
arrival order, and TGI batches the prompts waiting in it; measured in front of
llama-server, the first of five prompts dispatched within half a second saw its first
token third, 2.6 s after it was sent, where alone it took 0.4 s.  For such an engine
(``ServiceEstimate.shared_prefill``) every prompt being prefilled beside a newcomer
finishes with it (:func:`group_end`): the newcomer's first token comes when the group's
prompts are all prefilled, and so may the others', so admitting it must not push one of
them past its objective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluicegate.scheduler.request import Request
from sluicegate.scheduler.seat_limit import ServiceEstimate


def expected_output(request: Request, estimate: ServiceEstimate, produced: int) -> float:
    """Output tokens it will have in all: ``max_tokens`` when it ignores end-of-sequence,
    else the typical answer's length (or a little more than it has, if it is past that)."""
    limit = request.sampling.max_tokens
    if request.sampling.ignore_eos:
        return limit
    typical = estimate.mean_output_tokens
    return min(limit, max(typical, produced + 0.25 * typical))


def step_seconds(request: Request, estimate: ServiceEstimate) -> float:
    """Seconds per output token: the engine's step, or the request's own pace if slower."""
    return max(estimate.step_seconds, request.pace.min_token_interval_seconds)


def prompt_left(request: Request) -> int:
    """Prompt tokens it has still to prefill."""
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)


def ahead_in_lane(holder: Request, prompt_tokens: int, estimate: ServiceEstimate) -> int:
    """The prompt tokens a holder still has to prefill ahead of a new prompt of
    ``prompt_tokens``: all of them, unless the new one is short and the holder's long."""
    left = prompt_left(holder)
    threshold = estimate.long_prompt_tokens
    if threshold is not None and prompt_tokens <= threshold < left:
        return 0
    return left


@dataclass(slots=True, frozen=True)
class Prefilling:
    """A prompt being prefilled, or to be, on an engine that prefills its prompts together
    (times in seconds from now)."""

    #: When it reaches the engine (0: it is there).
    start: float
    tokens: int
    #: When its first token is due: its arrival plus its objective.
    due: float


def prefilling(
    holders: Sequence[Request],
    queued: Sequence[Request],
    starts: Sequence[float],
    now: float,
    objective_seconds: float,
) -> list[Prefilling]:
    """The prompts that a newcomer could be prefilled with: the holders' still being
    prefilled and the queued ones', at the times the seats' simulation starts them."""
    out = [
        Prefilling(0.0, left, r.arrival_time + objective_seconds - now)
        for r in holders
        if (left := prompt_left(r)) > 0
    ]
    out += [
        Prefilling(start, r.num_prompt_tokens, r.arrival_time + objective_seconds - now)
        for r, start in zip(queued, starts, strict=True)
    ]
    return out


def group_end(
    members: Sequence[Prefilling], start: float, tokens: int, prefill: Callable[[int], float]
) -> tuple[float, int]:
    """A newcomer of ``tokens`` reaching the engine at ``start``: when the prompts it is
    prefilled with (those whose prefill alone would still run then) and it are all
    prefilled, and how many of them that makes late that were not.  Conservative: what a
    member has already prefilled is not known, so all of its prompt is counted from the
    later of its start and now."""
    group = [m for m in members if m.start + prefill(m.tokens) > start]
    if not group:
        return start + prefill(tokens), 0
    others = sum(m.tokens for m in group)
    before = max(m.start for m in group) + prefill(others)
    end = start + prefill(others + tokens)
    return end, sum(1 for m in group if before <= m.due < end)
