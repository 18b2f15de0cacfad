"""``logprobs``, ``top_logprobs`` and ``n`` with the official ``openai`` client, unmodified,
against the real server, directly and through a gateway: what eval harnesses and
confidence scoring send.

Asserted is OpenAI's documented shape: per generated token, ``token``, ``logprob`` (at
most 0), ``bytes`` and ``top_logprobs`` (as many as asked, most likely first); the
tokens' bytes spell the answer; ``n`` choices indexed ``0..n-1``, each with its own
finish; the legacy completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``).  A seed gives the same answer streamed and not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob

from tests.clients.tools import SIM_MODEL
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a river in a sentence."}]


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.v1, api_key="unused") as client:
        yield client


def check_token_logprobs(entries: list[ChatCompletionTokenLogprob], top: int, text: str) -> None:
    """``entries`` are a choice's ``logprobs.content`` for the answer ``text``."""
    assert entries
    spelled = b""
    for entry in entries:
        assert entry.logprob <= 0.0
        assert entry.bytes is not None
        spelled += bytes(entry.bytes)
        assert len(entry.top_logprobs) == top
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert all(alt.logprob <= 0.0 and alt.bytes is not None for alt in entry.top_logprobs)
        if top and entry.token in {alt.token for alt in entry.top_logprobs}:
            # The sampled token among the alternatives carries its own log probability.
            same = [alt.logprob for alt in entry.top_logprobs if alt.token == entry.token]
            assert same[0] == pytest.approx(entry.logprob)
    answer = text.encode()
    assert spelled[: len(answer)] == answer
    # An answer cut by max_tokens may end inside a character: the bytes of its start are
    # in the logprobs (that is what ``bytes`` is for), not in the text.
    tail = spelled[len(answer) :]
    assert len(tail) < 4 and (not tail or tail[0] >= 0xC0), f"bytes past the text: {tail!r}"


@pytest.mark.parametrize("top", [0, 3, 20])
def test_chat_logprobs_cover_every_generated_token(client: openai.OpenAI, top: int) -> None:
    reply = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK, max_tokens=24, logprobs=True, top_logprobs=top, seed=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert reply.usage is not None
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    check_token_logprobs(choice.logprobs.content, top, choice.message.content or "")


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=8)
    assert reply.choices[0].logprobs is None


def test_streamed_logprobs_are_the_whole_answers(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": ASK,
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 9,
    }
    whole = client.chat.completions.create(**ask)
    text, entries = "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                entries += choice.logprobs.content or []
    assert whole.choices[0].logprobs is not None
    assert text == whole.choices[0].message.content
    assert entries == whole.choices[0].logprobs.content
    check_token_logprobs(entries, 2, text)


def test_n_answers_with_that_many_distinct_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=SIM_MODEL, messages=ASK, max_tokens=16, n=2, seed=4
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    texts = [choice.message.content for choice in reply.choices]
    assert all(texts) and texts[0] != texts[1]  # each choice seeded on its own
    assert all(choice.finish_reason in ("stop", "length") for choice in reply.choices)
    assert reply.usage is not None
    # Usage counts the generated tokens of every choice, the prompt once.
    single = client.chat.completions.create(model=SIM_MODEL, messages=ASK, max_tokens=1)
    assert single.usage is not None
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens


def test_n_streams_each_choice_by_index(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": SIM_MODEL,
        "messages": ASK,
        "max_tokens": 16,
        "n": 2,
        "seed": 4,
        "logprobs": True,
    }
    whole = client.chat.completions.create(**ask)
    texts = ["", ""]
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == [choice.message.content for choice in whole.choices]
    assert [finishes[0], finishes[1]] == [[c.finish_reason] for c in whole.choices]
    generated = 0
    for choice in whole.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        check_token_logprobs(choice.logprobs.content, 0, choice.message.content or "")
        generated += len(choice.logprobs.content)
    # Usage counts the generated tokens of every choice.
    assert whole.usage is not None and whole.usage.completion_tokens == generated


def test_completions_logprobs_in_the_legacy_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=SIM_MODEL, prompt="The river", max_tokens=12, logprobs=2, seed=6
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None
    tokens = logprobs.tokens or []
    assert reply.usage is not None and len(tokens) == reply.usage.completion_tokens
    assert logprobs.token_logprobs is not None and len(logprobs.token_logprobs) == len(tokens)
    assert all(value is not None and value <= 0.0 for value in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and len(logprobs.top_logprobs) == len(tokens)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    # text_offset: where each token starts, in characters, in order.
    assert logprobs.text_offset is not None and len(logprobs.text_offset) == len(tokens)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_completions_n_answers_each_choice(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=SIM_MODEL, prompt="The river", max_tokens=12, n=2, seed=6
    )
    assert sorted(choice.index for choice in reply.choices) == [0, 1]
    assert reply.choices[0].text != reply.choices[1].text
