"""Warm-up steps that seed the scheduler's cost model before any request arrives.

A handful of steps of varied shapes (decode batches of growing size at two context
lengths, a prefill chunk, a mixed step, the largest step the scheduler can plan) on
placeholder tokens, each run once to pay its
one-off costs and then timed three times (the median counts): enough for a first fit,
which every real step then refines.  They write into KV
slots that no request holds yet, and the slots are handed back clean.
"""

from __future__ import annotations

import statistics
import time

from sluicegate.engine.base import Engine
from sluicegate.scheduler.cost_model import StepShape
from sluicegate.scheduler.request import SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepPlan

#: A token every vocabulary has (the sim's byte-level one included).
_TOKEN = 1
_SAMPLING = SamplingParams(max_tokens=1, seed=0, temperature=0.0)


def warm_up(
    engine: Engine,
    num_slots: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    repeats: int = 3,
) -> list[tuple[StepShape, float]]:
    """Run the warm-up steps (every shape once unmeasured, then ``repeats`` times
    measured); returns each shape and the median of its measured seconds."""
    longest = max(1, max_model_len - 1)
    contexts = sorted({min(64, longest), min(512, longest)})
    plans: list[StepPlan] = []
    for context in contexts:
        for n in sorted({1, 4, min(16, num_slots)}):
            if n <= num_slots:
                plans.append(_decode(n, context))
    plans.append(_prefill(0, min(64, max_num_batched_tokens, longest), num_decoding=0, context=0))
    mixed = min(8, num_slots - 1)
    chunk = min(256, max_num_batched_tokens - mixed, longest)
    if mixed > 0 and chunk > 0:
        plans.append(_prefill(mixed, chunk, mixed, contexts[0]))
    # The largest step the scheduler can plan: every other slot decoding at the longer
    # context beside a prompt chunk that fills the token budget, so that the first fit
    # spans the shapes of a full batch rather than extrapolating to them.
    full = num_slots - 1
    chunk = min(max_num_batched_tokens - full, longest)
    if full > mixed and chunk > 0:
        plans.append(_prefill(full, chunk, full, contexts[-1]))
    for plan in plans:  # the first step of each shape pays one-off costs: not a sample
        engine.step(plan)
    timings: list[list[float]] = [[] for _ in plans]
    for _ in range(repeats):
        for plan, seconds in zip(plans, timings, strict=True):
            started = time.perf_counter()
            engine.step(plan)
            seconds.append(time.perf_counter() - started)
    engine.step(StepPlan(freed_kv_slots=list(range(num_slots))))
    # The median of each shape's timings: a step slowed by something else on the machine
    # (another process, a page fault) does not skew the first fit.
    return [
        (
            StepShape(len(plan.sequences), plan.num_batched_tokens, plan.num_context_tokens),
            statistics.median(seconds),
        )
        for plan, seconds in zip(plans, timings, strict=True)
    ]


def _decode(num_seqs: int, context: int) -> StepPlan:
    return StepPlan(sequences=[_sequence(slot, context, 1) for slot in range(num_seqs)])


def _prefill(slot: int, num_tokens: int, num_decoding: int, context: int) -> StepPlan:
    decoding = [_sequence(s, context, 1) for s in range(num_decoding)]
    return StepPlan(sequences=[*decoding, _sequence(slot, 0, num_tokens, prompt=num_tokens)])


def _sequence(slot: int, start: int, num_new: int, prompt: int = 1) -> ScheduledSequence:
    tokens = [_TOKEN] * (start + num_new)
    return ScheduledSequence(
        request_id=f"warm-up-{slot}",
        kv_slot=slot,
        all_token_ids=tokens,
        start_position=start,
        num_new_tokens=num_new,
        sample=True,
        sampling=_SAMPLING,
        num_prompt_tokens=min(prompt, len(tokens)),
    )
