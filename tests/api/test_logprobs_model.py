"""Log probabilities from SmolLM2 through the server (the session's,
:mod:`tests.support.model_server`), with the official client: entries carry the answer's
bytes, streamed deltas carry their own text's entries, completions take ``logprobs``.
(The engine's side: tests/engine/torch/test_sampling_surface_model.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.model_server import MODEL, TEST_TIMEOUT_SECONDS
from tests.support.servers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(TEST_TIMEOUT_SECONDS)]


async def test_logprobs_through_the_server(model_server: ServerProcess) -> None:
    """The official client against the server on SmolLM2: entries carry the answer's
    bytes, streamed deltas carry their own text's entries, and completions take
    ``logprobs``.  The three are asked at once (one batch; the logits of a sequence do
    not depend on its batch)."""
    async with openai.AsyncOpenAI(
        base_url=model_server.v1, api_key="unused", max_retries=0
    ) as client:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Say hello in Japanese and in French."}
        ]
        asked: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 30,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 4,
        }

        async def streamed_entries() -> list[Any]:
            entries = []
            async for chunk in await client.chat.completions.create(**asked, stream=True):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    entries.extend(chunk.choices[0].logprobs.content or [])
            return entries

        whole, streamed, completion = await asyncio.gather(
            client.chat.completions.create(**asked),
            streamed_entries(),
            client.completions.create(
                model=MODEL,
                prompt="The capital of France is",
                max_tokens=5,
                temperature=0,
                logprobs=2,
            ),
        )
        choice = whole.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content
        content = choice.logprobs.content
        joined = b"".join(bytes(e.bytes or []) for e in content)
        assert joined.startswith((choice.message.content or "").encode())
        for entry in content:
            assert len(entry.top_logprobs) == 4
            assert entry.top_logprobs[0].token == entry.token  # greedy
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
        lp = completion.choices[0].logprobs
        assert lp is not None and lp.token_logprobs and lp.top_logprobs
        assert all(v <= 0 for v in lp.token_logprobs)
        assert "".join(lp.tokens or []) == completion.choices[0].text
