"""Speculative decoding in the scheduler, against a fake model whose next token is a pure
function of the context: drafts change how many steps a sequence takes, never its tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.scheduler.step import StepPlan, StepResult

EOS = 0
Model = Callable[[list[int]], int]


def chain(context: list[int]) -> int:
    """Next token from the last one alone: text that repeats, as an edit copies its input."""
    return (context[-1] * 7 + 3) % 23 + 1


def noise(context: list[int]) -> int:
    """Next token from a hash of the whole context: nothing the prompt could predict."""
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return int.from_bytes(digest) % 1000 + 1


class FakeModel:
    """Computes a plan the way the engine does: positions land in the slot's 'KV' (here,
    the tokens they were computed from), and every position before a chunk must hold what
    the sequence's tokens say, so a rejected draft counted as computed fails the test."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.kv: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []

    def step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult()
        for seq in plan.sequences:
            held = self.kv.setdefault(seq.kv_slot, [])
            start = seq.start_position
            assert held[:start] == seq.all_token_ids[:start], "stale KV counted as computed"
            computed = seq.new_token_ids + seq.draft_token_ids
            held[start:] = computed
            if not seq.sample:
                continue
            context = seq.all_token_ids[: start + seq.num_new_tokens]
            result.sampled_token_ids[seq.request_id] = self.model(context)
            drafts = seq.draft_token_ids
            if drafts:
                result.draft_sampled_token_ids[seq.request_id] = [
                    self.model(context + drafts[: j + 1]) for j in range(len(drafts))
                ]
        return result


def run(
    model: Model, requests: list[Request], speculation: SpeculationConfig, **kw: Any
) -> tuple[Scheduler, FakeModel]:
    base: dict[str, Any] = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 512}
    base.update(kw)
    sched = Scheduler(SchedulerConfig(**base, speculation=speculation), eos_token_ids=(EOS,))
    engine = FakeModel(model)
    for request in requests:
        sched.add_request(request)
    for _ in range(5000):
        if not sched.has_unfinished_requests:
            break
        plan = sched.schedule()
        for event in sched.update_from_output(plan, engine.step(plan)):
            assert event.num_output_tokens == len(event.request.output_token_ids) or (
                not event.finished and event.num_output_tokens < event.request.num_output_tokens
            )
    assert not sched.has_unfinished_requests
    return sched, engine


def chain_prompt(length: int, first: int = 5) -> list[int]:
    tokens = [first]
    while len(tokens) < length:
        tokens.append(chain(tokens))
    return tokens


def request(rid: str, prompt: list[int], max_tokens: int, **sampling: Any) -> Request:
    params = SamplingParams(max_tokens=max_tokens, seed=1, **sampling)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling=params)


ON = SpeculationConfig(num_tokens=8)
OFF = SpeculationConfig(num_tokens=0)


def test_drafts_keep_the_tokens_and_save_steps_when_the_text_repeats() -> None:
    plain, plain_engine = run(chain, [request("a", chain_prompt(40), 60)], OFF)
    spec_requests = [request("a", chain_prompt(40), 60)]
    spec, spec_engine = run(chain, spec_requests, ON)
    assert spec_requests[0].output_token_ids == chain_prompt(100)[40:]
    assert spec_requests[0].finish_reason == FinishReason.LENGTH
    assert spec_requests[0].num_output_tokens == 60  # drafts never run past max_tokens
    assert len(spec_engine.plans) < len(plain_engine.plans) / 3
    counters = spec.make_stats().speculation
    assert counters is not None and plain.make_stats().speculation is None
    assert counters["accepted_tokens"] > 0.9 * counters["proposed_tokens"]
    assert max(len(s.draft_token_ids) for p in spec_engine.plans for s in p.sequences) == 8


def test_rejected_drafts_change_nothing_and_back_off() -> None:
    prompt = [noise(list(range(i))) % 3 + 1 for i in range(60)]  # small alphabet: n-grams recur
    plain = [request("a", prompt, 80)]
    run(noise, plain, OFF)
    spec = [request("a", prompt, 80)]
    sched, engine = run(noise, spec, ON)
    assert spec[0].output_token_ids == plain[0].output_token_ids
    drafted = [s for p in engine.plans for s in p.sequences if s.draft_token_ids]
    counters = sched.make_stats().speculation
    assert counters is not None
    # Failing drafts back off: far fewer drafting steps than decode steps.
    assert len(drafted) < 20


def test_a_stop_token_inside_accepted_drafts_ends_the_sequence_there() -> None:
    def stops_after_15(context: list[int]) -> int:
        return EOS if len(context) == 40 + 15 else chain(context)

    spec = [request("a", chain_prompt(40), 60)]
    run(stops_after_15, spec, ON)
    plain = [request("a", chain_prompt(40), 60)]
    run(stops_after_15, plain, OFF)
    assert spec[0].output_token_ids == plain[0].output_token_ids
    assert spec[0].output_token_ids[-1] == EOS and spec[0].num_output_tokens == 16
    assert spec[0].status == RequestStatus.FINISHED_STOPPED


def test_large_batches_paced_sequences_and_the_budget_get_no_drafts() -> None:
    many = [request(f"r{i}", chain_prompt(30, first=i + 2), 30) for i in range(6)]
    _, engine = run(chain, many, SpeculationConfig(num_tokens=8, max_batch=4), max_num_seqs=6)
    for plan in engine.plans:
        decoding = sum(1 for s in plan.sequences if s.start_position >= s.num_prompt_tokens)
        if decoding > 4:
            assert not any(s.draft_token_ids for s in plan.sequences)
        # A step's drafts share num_tokens: 8 for one sequence, 4 each for two ...
        assert sum(len(s.draft_token_ids) for s in plan.sequences) <= 8
        assert plan.num_batched_tokens <= 64
    paced = request("p", chain_prompt(40), 20)
    paced.pace.min_token_interval_seconds = 1e-9
    _, engine = run(chain, [paced], ON)
    assert not any(s.draft_token_ids for p in engine.plans for s in p.sequences)
    tight = [request("t", chain_prompt(40), 40)]
    _, engine = run(chain, tight, ON, max_num_batched_tokens=4, max_num_seqs=1)
    assert all(p.num_batched_tokens <= 4 for p in engine.plans)
    assert tight[0].output_token_ids == chain_prompt(80)[40:]


def test_drafts_stop_at_the_context_limit() -> None:
    spec = [request("a", chain_prompt(40), 100)]
    _, engine = run(chain, spec, ON, max_model_len=64)
    assert spec[0].num_tokens == 64 and spec[0].finish_reason == FinishReason.LENGTH
    assert all(
        s.start_position + s.num_scheduled_tokens <= 64 for p in engine.plans for s in p.sequences
    )
