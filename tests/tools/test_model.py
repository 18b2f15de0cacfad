"""Tool calling with the real model (SmolLM2) through the real server: sampled warm,
every call parses and validates, and streamed deltas assemble to the whole answer.

The server is the session's (:mod:`tests.support.model_server`); what is compared or
sampled is asked at once (eight answers cost about what one does, see there).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.support.model_server import MAX_NUM_SEQS, MODEL, TEST_TIMEOUT_SECONDS
from tests.support.servers import ServerProcess
from tests.tools.support import TOOLS

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(TEST_TIMEOUT_SECONDS)]

SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? And what is 2 + 3?"}]
NAMED = {"type": "function", "function": {"name": "add"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "height": {"type": "number"},
    },
    "required": ["name", "age", "height"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(model_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=model_server.v1, api_key="unused", max_retries=0, timeout=TEST_TIMEOUT_SECONDS
    ) as c:
        yield c


def ask(client: openai.OpenAI, choice: Any, seed: int, max_tokens: int = 200, **extra: Any) -> Any:
    """One call per answer (``parallel_tool_calls: false``): SmolLM2 given the choice
    repeats its call up to the limit, which costs time and tests nothing more (several
    calls are the grammar's and the parser's tests)."""
    return client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        seed=seed,
        temperature=0.8,
        max_tokens=max_tokens,
        **extra,
    )


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_eight_warm_answers_all_call_validly(client: openai.OpenAI, choice: Any) -> None:
    # Eight seeds at once, one batch (a grammar mask per sequence in every step): under
    # required, seeds 0-7 call both tools; under the named one, one of them has a float.
    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        replies = list(pool.map(lambda seed: ask(client, choice, seed), range(MAX_NUM_SEQS)))
    for seed, reply in enumerate(replies):
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls", (seed, answer)
        assert answer.message.content is None
        calls = answer.message.tool_calls or []
        assert len(calls) == 1, seed
        for call in calls:
            if choice is NAMED:
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", NAMED, "auto"], ids=["required", "named", "auto"])
def test_streamed_deltas_assemble_to_the_whole_answer(client: openai.OpenAI, choice: Any) -> None:
    # Under auto, seed 21's answer is text to max_tokens: 32 of them show as much.
    limit = 32 if choice == "auto" else 200
    # Both at once (seeded sampling is batch-invariant): a step of two sequences costs
    # about what a step of one does.
    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(ask, client, choice, 21, limit)
        chunks = list(ask(client, choice, 21, limit, stream=True))
    whole = asked.result().choices[0]
    content, finish = "", None
    calls: list[dict[str, str]] = []
    for chunk in chunks:
        for part in chunk.choices:
            content += part.delta.content or ""
            finish = part.finish_reason or finish
            for delta in part.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index == len(calls)
                    calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    expected = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or []
    ]
    assert calls == expected


def test_a_second_turn_with_the_results(client: openai.OpenAI) -> None:
    first = ask(client, "required", 5).choices[0].message
    assert first.tool_calls
    results = [
        {
            "role": "tool",
            "tool_call_id": c.id,
            "content": "21 degrees" if c.function.name == "get_weather" else "5",
        }
        for c in first.tool_calls
    ]
    messages = [*ASK, first.model_dump(exclude_none=True), *results]
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        seed=5,
        temperature=0.8,
        max_tokens=120,
    ).choices[0]
    assert second.finish_reason in ("stop", "length", "tool_calls")
    if second.message.tool_calls:  # auto: a call is well-formed too
        for call in second.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    else:
        assert second.message.content


def test_json_schema_numbers_end_at_temperature_0_8(client: openai.OpenAI) -> None:
    """The answer that once ran ``17349773888988888...`` to max_tokens: 5 of 5 parse
    (asked at once: one batch)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def one(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            seed=seed,
            temperature=0.8,
            max_tokens=200,
            response_format=fmt,
            messages=[{"role": "user", "content": "Describe a person as JSON: name, age, height."}],
        ).choices[0]

    with ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(one, range(5)))
    for answer in answers:
        assert answer.finish_reason == "stop", answer
        value = json.loads(answer.message.content or "")
        jsonschema.validate(value, PERSON)
        assert abs(value["age"]) < 2**63
