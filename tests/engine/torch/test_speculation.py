"""Prompt-lookup speculative decoding on SmolLM2: drafts verified in one pass give the
tokens plain decoding gives, greedy and seeded, with penalties (draft rows are penalised
as if the drafts had been decoded), alone and batched, and on edit prompts most drafts
are accepted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluicegate.engine.torch import TorchEngine
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from tests.engine.torch.drive import generate, run_requests

pytestmark = pytest.mark.slow

EDITS = [
    "Fix the spelling mistakes in this paragraph and write it out again:\n\n"
    "The bakery opens at seven in the morning. Every day we bake fresh bred, rolls and "
    "croissants, and our customers can by coffee as well. On saturdays the shop closes at "
    "one in the afternoon.",
    "Rename the variable x to total in this Python function and show the whole function:\n\n"
    "def add_all(numbers):\n    x = 0\n    for n in numbers:\n        x = x + n\n    return x\n",
]

SPECULATE = SpeculationConfig(num_tokens=8, max_batch=4)


def prompts(engine: TorchEngine) -> list[list[int]]:
    return [engine.tokenizer.encode_chat([{"role": "user", "content": e}]) for e in EDITS]


#: Tokens of each answer.
NUM_TOKENS = 32


def sampling() -> list[SamplingParams]:
    """For the edits twice over: greedy, then seeded; the second edit's with penalties."""
    greedy = SamplingParams(max_tokens=NUM_TOKENS, seed=0, temperature=0.0)
    seeded = SamplingParams(max_tokens=NUM_TOKENS, seed=11, temperature=0.7, top_p=0.9)
    return [
        greedy,
        replace(greedy, repetition_penalty=1.1, presence_penalty=0.2),
        seeded,
        replace(seeded, seed=21, frequency_penalty=0.3),
    ]


def test_verified_drafts_give_the_tokens_of_plain_decoding(engine_bf16: TorchEngine) -> None:
    """In bfloat16, the default dtype (both dtypes compute a chunk's positions as they
    compute them alone: tests/engine/torch/test_smollm2.py)."""
    engine = engine_bf16
    edit_prompts = prompts(engine) * 2  # each edit greedy and seeded
    params = sampling()
    plain = generate(engine, edit_prompts, max_new_tokens=NUM_TOKENS, sampling=params)
    pairs = enumerate(zip(edit_prompts, params, strict=True))
    requests = [Request(f"spec-{i}", list(p), s) for i, (p, s) in pairs]
    scheduler = run_requests(engine, requests, speculation=SPECULATE)
    assert [r.output_token_ids for r in requests] == plain
    counters = scheduler.make_stats().speculation
    assert counters is not None
    # Edits copy their input: most draft tokens are accepted.
    assert counters["accepted_tokens"] >= 0.5 * counters["proposed_tokens"] > 0, counters
    # Alone (one sequence, drafts of up to 8): the same tokens again.
    alone = Request("alone", list(edit_prompts[0]), params[0])
    run_requests(engine, [alone], speculation=SPECULATE)
    assert alone.output_token_ids == plain[0]
