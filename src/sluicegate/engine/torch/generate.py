"""A minimal scheduler loop for driving an engine directly (tests and benchmarks).

It plans steps the way the real scheduler does -- chunked prefill under a token budget,
then one token per step per running sequence, slots handed out and freed -- without
queues, priorities or backpressure.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from sluicegate.engine.base import Engine, EngineLimits
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepPlan


class LimitedEngine(Engine, Protocol):
    """An engine that states its limits (``TorchEngine`` does)."""

    @property
    def limits(self) -> EngineLimits: ...


@dataclass(slots=True)
class RunStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of up to ``max_tokens`` tokens."""
    return SamplingParams(max_tokens=max_tokens, seed=0, temperature=0.0)


def run_requests(
    engine: LimitedEngine,
    requests: Sequence[Request],
    chunk: int = 64,
    max_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    first_slot: int = 0,
) -> RunStats:
    """Run ``requests`` to completion, appending outputs to each ``all_token_ids``.

    A request may already hold output tokens (``all_token_ids`` longer than its prompt):
    it is then re-prefilled and continues, as after a preemption.  Stops at
    ``sampling.max_tokens`` outputs, at an eos id (unless ``ignore_eos``), at a stop
    token id, or at the engine's ``max_model_len``.  Slots are taken from ``first_slot``
    upwards, which lets tests place the same request in different slots.
    """
    limits = engine.limits
    num_slots = min(max_num_seqs or limits.max_num_seqs, limits.max_num_seqs - first_slot)
    if num_slots < 1:
        raise ValueError("no KV slots available")
    budget_per_step = max_batched_tokens or (1 << 62)
    free_slots = deque(range(first_slot, first_slot + num_slots))
    waiting = deque(requests)
    running: list[Request] = []
    freed: list[int] = []
    eos = set(engine.eos_token_ids)
    stats = RunStats()
    started = time.perf_counter()
    while waiting or running:
        while waiting and free_slots:
            request = waiting.popleft()
            request.kv_slot = free_slots.popleft()
            request.num_computed_tokens = 0
            running.append(request)
        plan = StepPlan(freed_kv_slots=freed)
        freed = []
        budget = budget_per_step
        for request in running:
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, chunk, budget)
            if n <= 0:
                continue
            budget -= n
            assert request.kv_slot is not None
            plan.sequences.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    kv_slot=request.kv_slot,
                    all_token_ids=request.all_token_ids,
                    start_position=request.num_computed_tokens,
                    num_new_tokens=n,
                    sample=n == remaining,
                    sampling=request.sampling,
                    num_prompt_tokens=request.num_prompt_tokens,
                )
            )
        result = engine.step(plan)
        stats.steps += 1
        for seq in plan.sequences:
            if seq.num_new_tokens == 1:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += seq.num_new_tokens
        by_id = {r.request_id: r for r in running}
        for seq in plan.sequences:
            request = by_id[seq.request_id]
            request.num_computed_tokens += seq.num_new_tokens
            token = result.sampled_token_ids.get(seq.request_id)
            if token is None:
                continue
            request.all_token_ids.append(token)
            sampling = request.sampling
            if (
                request.num_output_tokens >= sampling.max_tokens
                or (token in eos and not sampling.ignore_eos)
                or token in sampling.stop_token_ids
                or request.num_tokens >= limits.max_model_len
            ):
                running.remove(request)
                assert request.kv_slot is not None
                freed.append(request.kv_slot)
                free_slots.append(request.kv_slot)
                request.kv_slot = None
    stats.seconds = time.perf_counter() - started
    return stats


def generate(
    engine: LimitedEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    chunk: int = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_batched_tokens: int | None = None,
    first_slot: int = 0,
) -> list[list[int]]:
    """Generate from token-id ``prompts`` together; return each prompt's output ids.

    ``sampling`` is one ``SamplingParams`` for all, one per prompt, or greedy by default
    (its ``max_tokens`` is replaced by ``max_new_tokens``).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or greedy(max_new_tokens)] * len(prompts)
    else:
        params = list(sampling)
    requests = [
        Request(
            request_id=f"gen-{i}",
            prompt_token_ids=list(prompt),
            sampling=replace(p, max_tokens=max_new_tokens),
        )
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    run_requests(
        engine, requests, chunk=chunk, max_batched_tokens=max_batched_tokens, first_slot=first_slot
    )
    return [r.output_token_ids for r in requests]
