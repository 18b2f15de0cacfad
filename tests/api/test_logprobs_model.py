"""Log probabilities from SmolLM2 through the app, with the official client: entries
carry the answer's bytes, streamed deltas carry their own text's entries, completions
take ``logprobs``.  (The engine's side: tests/engine/torch/test_sampling_surface_model.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.inprocess import serve_in_process

pytestmark = [pytest.mark.slow, pytest.mark.model]


async def test_logprobs_through_the_app(torch_cache_dir: Path) -> None:
    """The official client against the app on SmolLM2: entries carry the answer's bytes,
    streamed deltas carry their own text's entries, and completions take ``logprobs``."""
    async with serve_in_process(
        engine="torch", max_num_seqs=2, max_model_len=512, cache_dir=str(torch_cache_dir)
    ) as app:
        client = app.openai(max_retries=0)
        model = app.service.model_name
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Say hello in Japanese and in French."}
        ]
        whole = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=30,
            temperature=0,
            logprobs=True,
            top_logprobs=4,
        )
        choice = whole.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content
        content = choice.logprobs.content
        joined = b"".join(bytes(e.bytes or []) for e in content)
        assert joined.startswith((choice.message.content or "").encode())
        for entry in content:
            assert len(entry.top_logprobs) == 4
            assert entry.top_logprobs[0].token == entry.token  # greedy
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=30,
            temperature=0,
            logprobs=True,
            top_logprobs=4,
            stream=True,
        )
        streamed = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed.extend(chunk.choices[0].logprobs.content or [])
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
        completion = await client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
        )
        lp = completion.choices[0].logprobs
        assert lp is not None and lp.token_logprobs and lp.top_logprobs
        assert all(v <= 0 for v in lp.token_logprobs)
        assert "".join(lp.tokens or []) == completion.choices[0].text
