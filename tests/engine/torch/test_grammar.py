"""Structured output on SmolLM2: answers under a JSON schema follow it, greedy and
seeded, batched, with speculative drafts, and across a preemption, and each of those
gives the tokens of plain constrained decoding."""

from __future__ import annotations

import json

import jsonschema

from sluicegate.engine.grammar import grammar_for_response_format
from sluicegate.engine.torch import TorchEngine
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from tests.engine.torch.drive import run_requests

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
    out = []
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        for params in (greedy, seeded):
            out.append(Request(f"{tag}-{len(out)}", list(ids), params))
    return out


def test_answers_follow_the_schema_alike_batched_with_drafts_and_after_preemption(
    engine_bf16: TorchEngine,
) -> None:
    engine = engine_bf16
    # Plain constrained decoding, each request alone.
    alone = requests(engine, "alone")
    for request in alone:
        run_requests(engine, [request])
    expected = [r.output_token_ids for r in alone]
    for request in alone:
        text = engine.tokenizer.decode(request.output_token_ids)
        jsonschema.validate(json.loads(text), SCHEMA)  # complete: it ended on its own
        assert request.num_output_tokens < 80, text
    # All four at once, with drafts: the same tokens (drafts the grammar forbids are
    # never accepted; the ones it allows are verified like any).
    batched = requests(engine, "batched")
    scheduler = run_requests(engine, batched, speculation=SPECULATE)
    assert [r.output_token_ids for r in batched] == expected
    counters = scheduler.make_stats().speculation
    assert counters is not None and counters["accepted_tokens"] > 0, counters
    # Preempted halfway (its output kept, its KV and its matcher gone): it re-prefills,
    # its matcher catches up with the output, and it ends as it would have.
    resumed = requests(engine, "resumed")
    for request, tokens in zip(resumed, expected, strict=True):
        request.all_token_ids.extend(tokens[: len(tokens) // 2])
    run_requests(engine, resumed)
    assert [r.output_token_ids for r in resumed] == expected


def test_an_output_its_grammar_cannot_follow_ends_the_answer(engine_bf16: TorchEngine) -> None:
    """A matcher that cannot catch up (an output that is not JSON: it should never happen)
    ends that answer with end-of-sequence instead of failing the whole step."""
    engine = engine_bf16
    grammar = grammar_for_response_format({"type": "json_object"})
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "JSON, please."}])
    bad = Request(
        "bad", list(prompt), SamplingParams(max_tokens=20, seed=0, temperature=0.0, grammar=grammar)
    )
    not_json = engine.tokenizer.tokenizer.encode("hello", add_special_tokens=False).ids
    bad.all_token_ids.extend(not_json)
    good = requests(engine, "beside")[0]
    run_requests(engine, [bad, good])
    assert bad.output_token_ids == [*not_json, bad.output_token_ids[-1]]
    assert bad.output_token_ids[-1] in engine.eos_token_ids
    text = engine.tokenizer.decode(good.output_token_ids)
    jsonschema.validate(json.loads(text), SCHEMA)  # the other request in the step is unharmed
