"""The official openai client, unmodified, against the app (sim engine), in process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.simtext import expected_chat, expected_completion
from tests.support.inprocess import serve_in_process

MODEL = "sluicegate-sim"


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with serve_in_process(max_num_seqs=64, max_model_len=1024) as app:
        yield app.openai(max_retries=0)


async def test_models_lists_served_model(client: openai.AsyncOpenAI) -> None:
    assert [m.id for m in (await client.models.list()).data] == [MODEL, EMBEDDING_MODEL]


async def test_chat_non_streaming(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        seed=7,  # type: ignore[arg-type]
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_chat(messages, 7, 40)
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 40
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 40


async def test_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=50,
        seed=3,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_chat(messages, 3, 50)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 50
    assert all(c.usage is None for c in chunks[:-1])


async def test_content_parts_equal_plain_string(client: openai.AsyncOpenAI) -> None:
    plain = [{"role": "user", "content": "one two"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
        }
    ]
    a = await client.chat.completions.create(model=MODEL, messages=plain, max_tokens=20, seed=1)  # type: ignore[arg-type]
    b = await client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, seed=1)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content


async def test_completions_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    full = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=30, seed=11)
    assert full.choices[0].text == expected_completion("Once upon", 11, 30)
    streamed = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=30, seed=11, stream=True
    )
    assert "".join([c.choices[0].text async for c in streamed]) == full.choices[0].text


async def test_seed_reproducible_and_distinct(client: openai.AsyncOpenAI) -> None:
    async def run(seed: int) -> str:
        r = await client.completions.create(model=MODEL, prompt="seeded", max_tokens=60, seed=seed)
        return r.choices[0].text

    assert await run(5) == await run(5)
    assert await run(5) != await run(6)


async def test_max_tokens_and_max_completion_tokens(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "count"}]
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=9, seed=2
    )  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == 9
    assert r.choices[0].finish_reason == "length"


async def test_stop_string_honoured_and_not_leaked(client: openai.AsyncOpenAI) -> None:
    prompt = "stop test"
    reference = expected_completion(prompt, 21, 400)
    # Pick a stop string that occurs in the reference after some text.
    words = reference.split(" ")
    stop = words[4] + " " + words[5]
    cut = reference.index(stop)
    r = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=400, seed=21, stop=[stop]
    )
    assert r.choices[0].text == reference[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=400, seed=21, stop=stop, stream=True
    )
    pieces = [c.choices[0].text async for c in streamed]
    assert "".join(pieces) == reference[:cut]
    assert stop not in "".join(pieces)


async def test_a_parameter_out_of_range_is_a_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            n=9,  # more choices than the embedded engine runs for one request
        )
    assert info.value.param == "n" and "between 1 and 8; got 9" in str(info.value)


async def test_structured_output_on_the_sim_engine_is_a_400_that_says_why(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            response_format={"type": "json_object"},
        )
    assert "sim engine" in str(info.value)
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    text = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        response_format={"type": "text"},
    )
    assert text.choices[0].message.content


async def test_unknown_model_is_a_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-nonexistent", prompt="x", max_tokens=2)
