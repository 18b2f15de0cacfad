"""The embedded engine through the real server, with the official openai client.

The server is the session's (:mod:`tests.support.model_server`): the default engine (no
``--engine`` flag), :data:`MAX_NUM_SEQS` seats of :data:`MAX_MODEL_LEN` positions.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluicegate.engine.torch.attention_batch import cache_positions
from tests.support.model_server import MAX_MODEL_LEN, MAX_NUM_SEQS, TEST_TIMEOUT_SECONDS
from tests.support.servers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(TEST_TIMEOUT_SECONDS)]


def test_capital_of_france_is_paris(model_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=model_server.v1, api_key="unused", max_retries=0)
    models = client.models.list()
    assert models.data[0].id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"
    client.close()


def test_streaming_and_context_limit(model_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=model_server.v1, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="word " * (MAX_MODEL_LEN + 100), max_tokens=4
        )
    assert f"maximum context length is {MAX_MODEL_LEN}" in str(info.value)
    client.close()


def test_kv_cache_memory_is_reported(model_server: ServerProcess) -> None:
    kv = model_server.stats()["kv_cache"]
    assert isinstance(kv, dict)
    # The default budget (auto) holds the slots asked for.
    assert kv["total_slots"] == MAX_NUM_SEQS
    # SmolLM2: 30 layers x (keys + values) x 3 KV heads x positions (a multiple of 32: no
    # padding, and one block more) x 64 dims, per slot.
    per_slot_per_byte = 30 * 2 * 3 * cache_positions(MAX_MODEL_LEN) * 64
    all_slots = MAX_NUM_SEQS * per_slot_per_byte
    assert kv["bytes"] in (all_slots * 2, all_slots * 4)  # bf16, f32
    text = httpx.get(model_server.base_url + "/metrics", timeout=5).text
    gauge = next(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sluicegate_kv_cache_bytes"
    )
    assert gauge == kv["bytes"]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_answers_parse_and_validate_batched_and_alone(
    model_server: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=model_server.v1, api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def ask(prompt: str, seed: int = 7) -> tuple[str, str | None]:
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            temperature=0.8,
            seed=seed,
            response_format=fmt,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason

    prompts = [
        "Describe a person who lives in Paris.",
        "Tell me about your grandmother.",
        "Who wrote Hamlet?",
        "Write a haiku about the sea.",
    ]
    with ThreadPoolExecutor(4) as pool:  # four at once: masks in a batched decode
        batched = list(pool.map(ask, prompts))
    for text, finish in batched:
        assert finish == "stop", text  # it ended because its JSON was complete
        jsonschema.validate(json.loads(text), PERSON)
    # Seeded sampling under a grammar is as reproducible as without: alone, the same text.
    assert ask(prompts[0]) == batched[0]
    client.close()


def test_json_object_mode_and_refused_formats(model_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=model_server.v1, api_key="unused", max_retries=0)
    messages = [
        {"role": "user", "content": 'What is the capital of France? Answer in JSON, key "capital".'}
    ]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,
        max_tokens=96,
        temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    bad_formats: list[tuple[dict[str, object], str]] = [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            "objekt",
        ),
        ({"type": "yaml"}, "'yaml'"),
        ({"type": "json_schema", "json_schema": "person"}, "json_schema must be an object"),
    ]
    for fmt, named in bad_formats:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,
                max_tokens=8,  # type: ignore[arg-type]
                response_format=fmt,  # type: ignore[arg-type]
            )
        assert named in str(info.value) and info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,
            max_tokens=8,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
            extra_body={"ignore_eos": True},
        )
    assert "ignore_eos" in str(info.value)
    client.close()
