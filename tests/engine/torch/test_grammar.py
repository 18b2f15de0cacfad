"""Structured output on SmolLM2: answers under a JSON schema follow it, greedy and
seeded, batched, with speculative drafts, and across a preemption, and each of those
gives the tokens of plain constrained decoding."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sluicegate.engine.grammar import grammar_for_response_format
from sluicegate.engine.torch import TorchEngine
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from tests.engine.torch.drive import run_requests

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 30},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}
PROMPTS = [
    'Change the age to 31 in this JSON and write it out again: {"name": "Ann Berg", '
    '"age": 30, "city": "Oslo", "pets": ["cat", "dog"]}',
    "Describe a fictional person as JSON.",
]
SPECULATE = SpeculationConfig(num_tokens=8, max_batch=4)


def requests(engine: TorchEngine, tag: str) -> list[Request]:
    grammar = grammar_for_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    )
    greedy = SamplingParams(max_tokens=80, seed=0, temperature=0.0, grammar=grammar)
    seeded = SamplingParams(max_tokens=80, seed=5, temperature=0.8, top_p=0.95, grammar=grammar)
    edit, describe = (
        engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]) for prompt in PROMPTS
    )
    # The edit copies its input (drafts are accepted), greedy and seeded; the description
    # makes its answer up.
    pairs = [(edit, greedy), (edit, seeded), (describe, greedy)]
    return [Request(f"{tag}-{i}", list(ids), params) for i, (ids, params) in enumerate(pairs)]


@pytest.fixture(scope="module")
def expected(engine_bf16: TorchEngine) -> list[list[int]]:
    """Plain constrained decoding: each request's answer, computed alone."""
    alone = requests(engine_bf16, "alone")
    for request in alone:
        run_requests(engine_bf16, [request])
    return [r.output_token_ids for r in alone]


def test_answers_follow_the_schema(engine_bf16: TorchEngine, expected: list[list[int]]) -> None:
    for tokens in expected:
        text = engine_bf16.tokenizer.decode(tokens)
        jsonschema.validate(json.loads(text), SCHEMA)  # complete: it ended on its own
        assert len(tokens) < 80, text


def test_answers_batched_with_drafts_are_the_answers_alone(
    engine_bf16: TorchEngine, expected: list[list[int]]
) -> None:
    """All three at once, with drafts: the same tokens (drafts the grammar forbids are
    never accepted; the ones it allows are verified like any)."""
    batched = requests(engine_bf16, "batched")
    scheduler = run_requests(engine_bf16, batched, speculation=SPECULATE)
    assert [r.output_token_ids for r in batched] == expected
    counters = scheduler.make_stats().speculation
    assert counters is not None and counters["accepted_tokens"] > 0, counters


def resumed_halfway(engine: TorchEngine, tag: str, expected: list[list[int]]) -> list[Request]:
    """The requests preempted halfway: their output kept, their KV and matchers gone."""
    resumed = requests(engine, tag)
    for request, tokens in zip(resumed, expected, strict=True):
        request.all_token_ids.extend(tokens[: len(tokens) // 2])
    return resumed


def test_answers_resumed_after_a_preemption_are_the_answers_alone(
    engine_bf16: TorchEngine, expected: list[list[int]]
) -> None:
    """Each re-prefills, its matcher catches up with its output, and it ends as it would
    have."""
    resumed = resumed_halfway(engine_bf16, "resumed", expected)
    run_requests(engine_bf16, resumed)
    assert [r.output_token_ids for r in resumed] == expected


def test_an_output_its_grammar_cannot_follow_ends_the_answer(
    engine_bf16: TorchEngine, expected: list[list[int]]
) -> None:
    """A matcher that cannot catch up (an output that is not JSON: it should never happen)
    ends that answer with end-of-sequence instead of failing the whole step; a matcher
    catching up beside it, and its answer, are unharmed."""
    engine = engine_bf16
    grammar = grammar_for_response_format({"type": "json_object"})
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "JSON, please."}])
    bad = Request(
        "bad", list(prompt), SamplingParams(max_tokens=20, seed=0, temperature=0.0, grammar=grammar)
    )
    not_json = engine.tokenizer.tokenizer.encode("hello", add_special_tokens=False).ids
    bad.all_token_ids.extend(not_json)
    good = resumed_halfway(engine, "beside", expected)[0]
    run_requests(engine, [bad, good])
    assert bad.output_token_ids == [*not_json, bad.output_token_ids[-1]]
    assert bad.output_token_ids[-1] in engine.eos_token_ids
    assert good.output_token_ids == expected[0]
