"""Prefix reuse on SmolLM2: an answer with a cache hit is bit-identical to a cold one,
whether the prefix is adopted in its cached slot or copied from a running sequence's.

In bfloat16, the default dtype: the rest of a prompt computed after a cached prefix is a
prefill chunk after others, and both dtypes compute a chunk's positions as they compute
them in one piece (tests/engine/torch/test_smollm2.py); the reuse itself (adopting a
slot, copying keys and values) does not depend on the dtype.
"""

from __future__ import annotations

import pytest

from sluicegate.engine.torch import TorchEngine
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from tests.engine.torch.drive import generate, greedy

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a bakery. Answer in one short sentence, mention the "
    "price when you know it, and never invent opening hours. Our bread: sourdough 4 euros, "
    "rye 3 euros, baguette 1.5 euros, brioche 5 euros. "
) * 3


def chat(engine: TorchEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    )


def scheduler_for(engine: TorchEngine, prefix_caching: bool = True) -> Scheduler:
    limits = engine.limits
    config = SchedulerConfig(
        limits.max_num_seqs, 64, limits.max_model_len, prefix_caching=prefix_caching
    )
    return Scheduler(config, eos_token_ids=engine.eos_token_ids)


def run(
    engine: TorchEngine,
    scheduler: Scheduler,
    requests: list[Request],
    start_after: dict[str, int] | None = None,
) -> list[tuple[int, int, int]]:
    """Run to completion; a request named in ``start_after`` is added once the step
    count reaches its value.  Returns the KV copies the plans asked for."""
    start_after = start_after or {}
    pending = [r for r in requests if r.request_id in start_after]
    for r in requests:
        if r.request_id not in start_after:
            scheduler.add_request(r)
    copies: list[tuple[int, int, int]] = []
    steps = 0
    while scheduler.has_unfinished_requests or pending:
        for r in [r for r in pending if start_after[r.request_id] <= steps]:
            scheduler.add_request(r)
            pending.remove(r)
        plan = scheduler.schedule()
        copies += plan.kv_copies
        if not plan.is_empty:
            scheduler.update_from_output(plan, engine.step(plan))
        steps += 1
    return copies


def test_a_repeated_prompt_reuses_its_cached_slot_and_answers_the_same(
    engine_bf16: TorchEngine,
) -> None:
    engine = engine_bf16
    prompt = chat(engine, "How much is the rye bread?")
    seeded = SamplingParams(max_tokens=8, seed=7, temperature=0.8, top_p=0.9)
    cold = generate(engine, [prompt, prompt], 8, sampling=[greedy(8), seeded])
    scheduler = scheduler_for(engine)
    first = Request("first", prompt, greedy(8))
    run(engine, scheduler, [first])
    again = Request("again", prompt, greedy(8))
    sampled = Request("sampled", list(prompt), seeded)
    copies = run(engine, scheduler, [again, sampled])
    assert first.output_token_ids == again.output_token_ids == cold[0]
    assert sampled.output_token_ids == cold[1]
    reusable = len(prompt) - 1  # all but the last prompt token, which gives the logits
    assert again.reuse.num_cached_tokens == reusable  # adopted: the first answer's own slot
    # The second request found the same prefix in the first's slot while "again" held it.
    assert sampled.reuse.num_cached_tokens == reusable and copies
    stats = scheduler.kv.prefix.stats if scheduler.kv.prefix else None
    assert stats is not None and stats.hits == 2 and stats.hit_tokens == 2 * reusable


def test_a_conversations_second_turn_reuses_the_first_turns_prompt_and_answer(
    engine_bf16: TorchEngine,
) -> None:
    engine = engine_bf16
    scheduler = scheduler_for(engine)
    question = "How much is the rye bread?"
    first = Request("turn-1", chat(engine, question), greedy(16))
    run(engine, scheduler, [first])
    answer = engine.tokenizer.decode(first.output_token_ids)
    second_prompt = engine.tokenizer.encode_chat(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And rye?"},
        ]
    )
    second = Request("turn-2", second_prompt, greedy(10))
    run(engine, scheduler, [second])
    # Everything up to the first answer's last full block is reused.
    assert second.reuse.num_cached_tokens >= len(first.prompt_token_ids) - 16
    assert second.output_token_ids == generate(engine, [second_prompt], 10)[0]
