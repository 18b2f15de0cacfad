"""``--weights q4`` through the real server: SmolLM2's GGUF served with its own 4-bit
blocks for answers (bfloat16 activations inside a float32 server), asked through the
official client."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from sluicegate.engine.torch.q4 import supported
from tests.support.servers import ServerProcess, start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(not supported(), reason="no int4 CPU kernel in this torch"),
]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def q4_server(torch_cache_dir: Path) -> Iterator[ServerProcess]:
    server = start_server(
        [
            *("--weights", "q4", "--cache-dir", str(torch_cache_dir)),
            *("--dtype", "float32"),  # the kernel casts; every machine has float32
            *("--max-num-seqs", "4", "--max-model-len", "512", "--admission", "static"),
        ],
        "q4",
    )
    yield server
    server.stop()


def ask(client: openai.OpenAI, seed: int, stream: bool = False) -> str:
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    if not stream:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0.8, seed=seed
        )
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0.8, seed=seed, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_answers_through_4_bit_weights(q4_server: ServerProcess) -> None:
    weights = q4_server.stats()["weights"]
    assert isinstance(weights, dict)
    assert weights["answers"] == "q4" and int(weights["q4_bytes"]) > 40_000_000
    with openai.OpenAI(base_url=q4_server.v1, api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        # Seeded answers are the same alone, streamed, and beside others.
        alone = ask(client, 7)
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda s: ask(client, s), [7, 8, 9]))
        assert together[0] == alone == ask(client, 7, stream=True)
        assert len(set(together)) == 3
