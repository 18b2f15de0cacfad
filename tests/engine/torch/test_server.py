"""The embedded engine through the real server, with the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def torch_server(torch_cache_dir: Path) -> Iterator[ServerProcess]:
    cache = torch_cache_dir
    # The default engine: no --engine flag.
    server = start_server(
        ["--max-num-seqs", "4", "--max-model-len", "512", "--cache-dir", str(cache)], "torch"
    )
    yield server
    server.stop()


def test_capital_of_france_is_paris(torch_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=torch_server.v1, api_key="unused", max_retries=0)
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


def test_streaming_and_context_limit(torch_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=torch_server.v1, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=24, temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="word " * 600, max_tokens=4)
    assert "maximum context length is 512" in str(info.value)
    client.close()


def test_kv_cache_memory_is_reported(torch_server: ServerProcess) -> None:
    kv = torch_server.stats()["kv_cache"]
    assert isinstance(kv, dict)
    assert kv["total_slots"] == 4  # the default budget (auto) holds the 4 slots asked for
    # SmolLM2: 30 layers x (keys + values) x 3 KV heads x 512 positions x 64 dims, per slot.
    per_slot_per_byte = 30 * 2 * 3 * 512 * 64
    assert kv["bytes"] in (4 * per_slot_per_byte * 2, 4 * per_slot_per_byte * 4)  # bf16, f32
    text = httpx.get(torch_server.base_url + "/metrics", timeout=5).text
    gauge = next(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sluicegate_kv_cache_bytes"
    )
    assert gauge == kv["bytes"]
