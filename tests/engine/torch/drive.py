"""Drive an engine with the real scheduler, the way the engine thread does, for tests.

The loop is ``schedule`` → ``engine.step`` → ``update_from_output`` until no request is
left, without queues or streams.  Chunked prefill comes from the step's token budget
(``max_num_batched_tokens``), as in the server.

The scheduler hands KV slots out lowest first, so a request run alone sits in slot 0.  To
compute requests in other slots, ``hold_slots`` holder requests are added first: they take
the lowest slots, decode one token per step each (out of the budget), and finish once
every request under test has its slot.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from sluicegate.engine.base import Engine, EngineLimits
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.scheduler.step import StepPlan, StepResult, TokenLogprobs

#: Request ids of the slot holders start with this (to leave them out of recorded plans).
HOLDER_ID_PREFIX = "hold-"


class LimitedEngine(Engine, Protocol):
    """An engine that states its limits (``TorchEngine`` does)."""

    @property
    def limits(self) -> EngineLimits: ...


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of up to ``max_tokens`` tokens."""
    return SamplingParams(max_tokens=max_tokens, seed=0, temperature=0.0)


def run_requests(
    engine: LimitedEngine,
    requests: Sequence[Request],
    max_num_batched_tokens: int = 64,
    hold_slots: int = 0,
    speculation: SpeculationConfig | None = None,
) -> Scheduler:
    """Run ``requests`` to completion, appending outputs to each ``all_token_ids``;
    returns the scheduler (for its counters).

    A request may already hold output tokens (``all_token_ids`` longer than its prompt):
    it is then re-prefilled and continues, as after a preemption.  Requests stop as the
    scheduler stops them (``max_tokens``, eos unless ``ignore_eos``, a stop token id, the
    engine's ``max_model_len``).  With ``hold_slots``, no request under test is ever
    planned in one of the ``hold_slots`` lowest slots (checked every step).
    """
    limits = engine.limits
    config = SchedulerConfig(
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=limits.max_model_len,
        speculation=speculation or SpeculationConfig(num_tokens=0),
    )
    scheduler = Scheduler(config, eos_token_ids=engine.eos_token_ids)
    # A one-token prompt and no stop of their own: holders live until released below.
    hold = SamplingParams(max_tokens=limits.max_model_len, seed=0, temperature=0.0, ignore_eos=True)
    holders = [Request(f"{HOLDER_ID_PREFIX}{i}", [0], hold) for i in range(hold_slots)]
    for request in [*holders, *requests]:
        scheduler.add_request(request)
    under_test = {r.request_id for r in requests}
    without_slot = set(under_test)
    while scheduler.has_unfinished_requests:
        plan = scheduler.schedule()
        if plan.is_empty:
            raise RuntimeError("the scheduler planned an empty step with requests left")
        for seq in plan.sequences:
            if seq.request_id in under_test and seq.kv_slot < hold_slots:
                raise AssertionError(
                    f"{seq.request_id} planned in KV slot {seq.kv_slot}, below {hold_slots}"
                )
            without_slot.discard(seq.request_id)
        if holders and not without_slot:
            # Every request under test has its slot: each holder stops at its next token.
            for holder in holders:
                holder.sampling = replace(holder.sampling, max_tokens=1)
            holders = []
        scheduler.update_from_output(plan, engine.step(plan))
    return scheduler


def generate(
    engine: LimitedEngine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_num_batched_tokens: int = 64,
    hold_slots: int = 0,
    speculation: SpeculationConfig | None = None,
) -> list[list[int]]:
    """Generate from token-id ``prompts`` together; return each prompt's output ids.

    ``sampling`` is one ``SamplingParams`` for all, one per prompt, or greedy by default
    (its ``max_tokens`` is replaced by ``max_new_tokens``).  Requests are added in
    ``prompts`` order, so earlier prompts take lower slots.
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
    run_requests(engine, requests, max_num_batched_tokens, hold_slots, speculation)
    return [r.output_token_ids for r in requests]


class RecordingEngine:
    """Wraps an engine and remembers every plan it ran (slot holders left out: they are
    not the requests under test)."""

    def __init__(self, engine: LimitedEngine) -> None:
        self.engine = engine
        self.plans: list[list[int]] = []  # num_new_tokens per sequence, per step
        self.chunks: dict[str, list[int]] = defaultdict(list)  # request -> num_new_tokens
        self.slots: dict[int, set[str]] = defaultdict(set)  # KV slot -> requests it held
        self.logprobs: dict[str, list[TokenLogprobs]] = {}  # of the tokens sampled

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def step(self, plan: StepPlan) -> StepResult:
        tested = [s for s in plan.sequences if not s.request_id.startswith(HOLDER_ID_PREFIX)]
        self.plans.append([s.num_new_tokens for s in tested])
        for s in tested:
            self.chunks[s.request_id].append(s.num_new_tokens)
            self.slots[s.kv_slot].add(s.request_id)
        result = self.engine.step(plan)
        for request_id, entries in result.logprobs.items():
            self.logprobs.setdefault(request_id, []).extend(entries)
        return result

    def close(self) -> None:
        self.engine.close()
