"""Log probabilities through the whole path (engine, deliveries, stream, response) with
the official openai client, on the sim engine in process: its log probabilities are a
pure function of (seed, output position, token), so every value is known in advance."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from sluicegate.engine.sim import sim_logprobs
from tests.simtext import expected_chat, expected_completion
from tests.support.inprocess import serve_in_process

MODEL = "sluicegate-sim"
QUESTION = "Tell me about rivers."
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
#: The same, as the sim's expected text takes it.
PROMPT = [{"role": "user", "content": QUESTION}]


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with serve_in_process(max_num_seqs=16, max_model_len=1024) as app:
        yield app.openai(max_retries=0)


def expected_entries(seed: int, num_tokens: int, num_top: int) -> list[dict[str, Any]]:
    """The sim's entries for its first ``num_tokens`` output tokens of ``MESSAGES``."""
    token_ids = list(expected_chat(PROMPT, seed, num_tokens + 8).encode())[:num_tokens]
    entries = []
    for i, token_id in enumerate(token_ids):
        lp = sim_logprobs(seed, i, token_id, num_top)
        top = [
            {"token": bytes([t]).decode(errors="replace"), "logprob": v, "bytes": [t]}
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        ]
        entries.append(
            {
                "token": bytes([token_id]).decode(errors="replace"),
                "logprob": lp.logprob,
                "bytes": [token_id],
                "top_logprobs": top,
            }
        )
    return entries


def joined_bytes(entries: list[Any]) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries)


async def test_chat_logprobs_with_alternatives(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, seed=7, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert [e.model_dump() for e in content] == expected_entries(7, 40, 3)
    # The entries' bytes are the answer's text (a character cut by max_tokens aside).
    text = (choice.message.content or "").encode()
    assert joined_bytes(content).startswith(text) and len(joined_bytes(content)) - len(text) < 4
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


async def test_chat_logprobs_without_alternatives(client: openai.AsyncOpenAI) -> None:
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=3, logprobs=True
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    assert all(e.top_logprobs == [] for e in content)
    # Asked not to: none.
    plain = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=3
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == resp.choices[0].message.content


async def test_streamed_entries_follow_their_text(client: openai.AsyncOpenAI) -> None:
    """Each chunk carries the entries of exactly the text it carries; together they are
    the non-streamed answer's."""
    whole = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, seed=11, logprobs=True, top_logprobs=2
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries: list[Any] = []
    text = ""
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta_entries = choice.logprobs.content if choice.logprobs is not None else None
        delta_text = choice.delta.content or ""
        if choice.finish_reason is None:
            assert joined_bytes(delta_entries or []) == delta_text.encode()
        entries.extend(delta_entries or [])
        text += delta_text
    assert text == whole.choices[0].message.content
    assert whole.choices[0].logprobs is not None
    assert [e.model_dump() for e in entries] == [
        e.model_dump() for e in whole.choices[0].logprobs.content or []
    ]


async def test_a_stop_string_ends_the_entries_with_the_text(client: openai.AsyncOpenAI) -> None:
    full = expected_chat(PROMPT, 5, 200)
    words = full.split(" ")
    stop = next(w for w in words[3:] if len(w) >= 4 and w.isascii())
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        seed=5,
        stop=[stop],
        logprobs=True,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == full[: full.index(stop)]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert joined_bytes(choice.logprobs.content) == full[: full.index(stop)].encode()


async def test_completions_logprobs(client: openai.AsyncOpenAI) -> None:
    prompt = "Once upon"
    resp = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, seed=13, logprobs=2
    )
    choice = resp.choices[0]
    assert choice.text == expected_completion(prompt, 13, 30)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    # Tokens are bytes; the 30th may end inside a character the text leaves out.
    token_ids = list(expected_completion(prompt, 13, 40).encode())[:30]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(token_ids)
    assert lp.token_logprobs == [sim_logprobs(13, i, t, 2).logprob for i, t in enumerate(token_ids)]
    # The alternatives and the sampled token, as OpenAI gives them (k + 1 at most).
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and top[token] == value
    assert lp.text_offset[0] == 0
    # Streamed, the same numbers.
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, seed=13, logprobs=2, stream=True
    )
    streamed: list[float] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs or [])
    assert streamed == lp.token_logprobs


async def test_penalties_are_accepted_and_change_nothing_on_the_sim(
    client: openai.AsyncOpenAI,
) -> None:
    plain = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, seed=9
    )
    penalised = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=30,
        seed=9,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        logit_bias={"65": 100},
        extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
    )
    assert penalised.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_bad_logprobs_are_400(
    client: openai.AsyncOpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **body)
    assert caught.value.body is not None
    assert caught.value.body["param"] == param  # type: ignore[index]
