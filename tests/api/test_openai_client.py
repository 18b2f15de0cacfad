"""The official openai client against the real server (sim engine)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.conftest import ServerProcess
from tests.simtext import expected_chat, expected_completion

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


@pytest.fixture
def client(sim_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """A client per test, closed after it (its pooled connections with it)."""
    with openai.OpenAI(base_url=sim_server.v1, api_key="unused", max_retries=0) as client:
        yield client


def test_models_lists_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    resp = client.chat.completions.create(
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


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=50, seed=3,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_chat(messages, 3, 50)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 50
    assert all(c.usage is None for c in chunks[:-1])


def test_content_parts_equal_plain_string(client: openai.OpenAI) -> None:
    plain = [{"role": "user", "content": "one two"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
        }
    ]
    a = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=20, seed=1)  # type: ignore[arg-type]
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=20, seed=1)  # type: ignore[arg-type]
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=30, seed=11)
    assert full.choices[0].text == expected_completion("Once upon", 11, 30)
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=30, seed=11, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text


def test_seed_reproducible_and_distinct(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="seeded", max_tokens=60, seed=seed)
        return r.choices[0].text

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "count"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=9, seed=2
    )  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.completion_tokens == 9
    assert r.choices[0].finish_reason == "length"


def test_stop_string_honoured_and_not_leaked(client: openai.OpenAI) -> None:
    prompt = "stop test"
    reference = expected_completion(prompt, 21, 400)
    # Pick a stop string that occurs in the reference after some text.
    words = reference.split(" ")
    stop = words[4] + " " + words[5]
    cut = reference.index(stop)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, seed=21, stop=[stop])
    assert r.choices[0].text == reference[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=400, seed=21, stop=stop, stream=True
    )
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == reference[:cut]
    assert stop not in "".join(pieces)


def test_unsupported_parameter_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            n=2,  # type: ignore[list-item]
        )
    assert "'n'" in str(info.value)


def test_structured_output_on_the_sim_engine_is_a_400_that_says_why(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert "sim engine" in str(info.value)
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
        response_format={"type": "text"},
    )  # fmt: skip
    assert text.choices[0].message.content


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nonexistent", prompt="x", max_tokens=2)
