"""An upstream's events parsed choice by choice, tool calls held until whole, and an
answer asked again matched against what its client has (restart-and-skip), without
servers."""

from __future__ import annotations

from typing import Any

import pytest

from sluicegate.config import Settings
from sluicegate.engine.upstream.choices import AnswerState, Diverged, Piece
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.signals import context_length
from sluicegate.engine.upstream.wire import (
    ChoiceDelta,
    UpstreamCall,
    chat_logprobs,
    parse_event,
    request_body,
)


def test_every_choice_and_part_of_an_event_is_kept() -> None:
    event = parse_event(
        b'{"choices":[{"index":1,"delta":{"content":"a","refusal":"no",'
        b'"tool_calls":[{"index":0,"id":"c1","type":"function",'
        b'"function":{"name":"f","arguments":"{"}}]},'
        b'"logprobs":{"content":[{"token":"a","logprob":-1.0,"bytes":[97],"top_logprobs":[]}]},'
        b'"finish_reason":null},'
        b'{"index":0,"delta":{},"finish_reason":"tool_calls"}]}'
    )
    assert event is not None
    one, zero = event.choices
    assert (one.index, one.text, one.refusal) == (1, "a", "no")
    assert one.tool_calls == [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    ]
    assert one.logprobs[0]["token"] == "a" and one.finish_reason is None
    assert (zero.index, zero.has_content, zero.finish_reason) == (0, False, "tool_calls")


def test_legacy_log_probabilities_become_chat_entries() -> None:
    legacy = {
        "tokens": ["é", "x"],
        "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {"x": -0.5, "y": -2.0}],
        "text_offset": [0, 2],
    }
    assert chat_logprobs(legacy) == [
        {"token": "é", "logprob": None, "bytes": [195, 169], "top_logprobs": []},
        {
            "token": "x",
            "logprob": -0.5,
            "bytes": [120],
            "top_logprobs": [
                {"token": "x", "logprob": -0.5, "bytes": [120]},
                {"token": "y", "logprob": -2.0, "bytes": [121]},
            ],
        },
    ]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"id": "m", "max_model_len": 4096}, 4096),  # vLLM, SGLang, Sluicegate
        ({"id": "m", "meta": {"n_ctx_train": 8192}}, 8192),  # llama.cpp
        ({"id": "m", "meta": {"n_ctx": 2048, "n_ctx_train": 8192}}, 2048),
        ({"id": "m"}, None),  # Ollama, TGI: unknown
        ({"id": "m", "max_model_len": True}, None),
    ],
)
def test_the_context_an_upstream_model_takes(entry: dict[str, Any], expected: int | None) -> None:
    assert context_length(entry) == expected


def test_a_models_context_is_the_least_its_upstreams_say() -> None:
    settings = Settings(
        engine="upstream",
        upstreams=[
            {"url": "http://10.0.0.1:8000", "name": "a"},
            {"url": "http://10.0.0.2:8000", "name": "b", "models": {"big": "their-big"}},
        ],
    )
    pool = UpstreamPool(settings)
    a, b = pool.upstreams
    a.models, a.context_lengths = ["big", "small"], {"big": 8192, "small": 2048}
    b.models, b.context_lengths = ["their-big"], {"their-big": 4096}
    assert pool.max_model_len("big") == 4096  # b names it its own way
    assert pool.max_model_len("small") == 2048
    assert pool.max_model_len("other") is None


def fragment(position: int, arguments: str, call_id: str | None = None, name: str = "") -> Any:
    out: dict[str, Any] = {"index": position, "function": {"arguments": arguments}}
    if call_id is not None:
        out |= {"id": call_id, "type": "function"}
        out["function"]["name"] = name
    return out


def feed(answer: AnswerState, *deltas: ChoiceDelta) -> list[Piece]:
    return [p for d in deltas if not (p := answer.absorb(d)).empty]


def test_a_call_goes_out_whole_when_its_arguments_are_whole() -> None:
    answer = AnswerState()
    answer.begin_call(restart=True)
    pieces = feed(
        answer,
        ChoiceDelta(tool_calls=[fragment(0, "", "c1", "f")]),
        ChoiceDelta(tool_calls=[fragment(0, '{"a": "}"')]),  # a brace inside a string
    )
    assert pieces == []  # held: half a call never goes out
    assert answer.needs_restart  # a held call cannot be continued by appending text
    (piece,) = feed(answer, ChoiceDelta(tool_calls=[fragment(0, ', "b": 1}')]))
    assert piece.tool_calls == [
        {
            "index": 0,
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a": "}", "b": 1}'},
        }
    ]
    assert feed(answer, ChoiceDelta(tool_calls=[fragment(0, " ")])) == []  # nothing more
    (piece,) = feed(answer, ChoiceDelta(tool_calls=[fragment(1, "{}", "c2", "g")]))
    assert piece.tool_calls[0]["function"] == {"name": "g", "arguments": "{}"}
    (piece,) = feed(answer, ChoiceDelta(finish_reason="tool_calls"))
    assert (piece.tool_calls, piece.finish) == ([], "tool_calls")


def test_a_call_goes_out_whole_when_the_next_begins_or_its_choice_ends() -> None:
    """Arguments that never form a whole object (an upstream cut by its length) go out
    as they are when the choice ends."""
    answer = AnswerState()
    answer.begin_call(restart=True)
    assert feed(answer, ChoiceDelta(tool_calls=[fragment(0, '{"a": 1', "c1", "f")])) == []
    (piece,) = feed(answer, ChoiceDelta(tool_calls=[fragment(1, "{", "c2", "g")]))
    assert piece.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    (piece,) = feed(answer, ChoiceDelta(finish_reason="length"))
    assert piece.tool_calls[0]["function"] == {"name": "g", "arguments": "{"}
    assert piece.finish == "length"


def test_an_answer_asked_again_goes_on_where_its_client_is() -> None:
    answer = AnswerState()
    answer.begin_call(restart=True)
    feed(
        answer,
        ChoiceDelta(text="Hello"),
        ChoiceDelta(tool_calls=[fragment(0, "{}", "c1", "f")]),
        ChoiceDelta(tool_calls=[fragment(1, '{"x"', "c2", "g")]),
    )  # and then the upstream died: the client has "Hello" and call c1
    answer.begin_call(restart=True)
    pieces = feed(
        answer,
        ChoiceDelta(text="Hel"),
        ChoiceDelta(text="lo"),
        ChoiceDelta(tool_calls=[fragment(0, "{}", "other-id", "f")]),  # ids may differ
        ChoiceDelta(tool_calls=[fragment(1, '{"x": 2}', "c9", "g")]),
        ChoiceDelta(finish_reason="tool_calls"),
    )
    # Only what the client lacks goes out: the second call (whole), then the finish.
    assert [(p.text, p.finish) for p in pieces] == [("", None), ("", "tool_calls")]
    assert pieces[0].tool_calls == [
        {
            "index": 1,
            "id": "c9",
            "type": "function",
            "function": {"name": "g", "arguments": '{"x": 2}'},
        }
    ]
    assert answer.end_call() == []


def test_text_beyond_what_the_client_has_goes_out_from_the_right_character() -> None:
    answer = AnswerState()
    answer.begin_call(restart=True)
    feed(answer, ChoiceDelta(text="Hello wor"))
    answer.begin_call(restart=True)
    pieces = feed(answer, ChoiceDelta(text="Hello"), ChoiceDelta(text=" world"))
    assert [p.text for p in pieces] == ["ld"]


@pytest.mark.parametrize(
    ("again", "why"),
    [
        ([ChoiceDelta(text="Help")], "text differs at character 3"),
        ([ChoiceDelta(text="Hello"), ChoiceDelta(finish_reason="stop")], "ended before"),
        (
            [
                ChoiceDelta(text="Hello there"),
                ChoiceDelta(tool_calls=[fragment(0, '{"b": 1}', "c", "f")]),
                ChoiceDelta(finish_reason="tool_calls"),
            ],
            "tool call 0 differs",
        ),
    ],
)
def test_an_answer_asked_again_that_differs_is_refused(again: list[ChoiceDelta], why: str) -> None:
    answer = AnswerState()
    answer.begin_call(restart=True)
    feed(
        answer,
        ChoiceDelta(text="Hello there"),
        ChoiceDelta(tool_calls=[fragment(0, '{"a": 1}', "c", "f")]),
        ChoiceDelta(tool_calls=[fragment(1, "{", "d", "f")]),
    )
    answer.begin_call(restart=True)
    with pytest.raises(Diverged, match=why):
        feed(answer, *again)
        answer.end_call()


def test_several_choices_are_matched_each_on_its_own() -> None:
    answer = AnswerState(num_choices=2)
    answer.begin_call(restart=True)
    feed(answer, ChoiceDelta(index=1, text="B", finish_reason="stop"), ChoiceDelta(text="A"))
    assert answer.needs_restart and not answer.whole
    answer.begin_call(restart=True)
    pieces = feed(
        answer,
        ChoiceDelta(text="A"),
        ChoiceDelta(index=1, text="B", finish_reason="stop"),  # finished already: skipped
        ChoiceDelta(text="AA", finish_reason="length"),
    )
    assert [(p.index, p.text, p.finish) for p in pieces] == [(0, "AA", "length")]
    assert answer.whole
    answer.begin_call(restart=True)
    with pytest.raises(Diverged, match="past the end"):
        feed(answer, ChoiceDelta(index=1, text="Bb"))


def test_a_text_answer_is_continued_not_asked_again() -> None:
    answer = AnswerState()
    answer.begin_call(restart=True)
    feed(answer, ChoiceDelta(text="Once", logprobs=[{"token": "Once"}]))
    assert answer.delivered and not answer.needs_restart
    assert answer.partial_text == "Once"
    answer.begin_call(restart=False)  # a continuation: what comes is new
    pieces = feed(answer, ChoiceDelta(text=" upon", logprobs=[{"token": " upon"}]))
    assert [(p.text, len(p.logprobs)) for p in pieces] == [(" upon", 1)]


def test_a_chat_continued_as_a_completion_keeps_its_log_probabilities() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    chat = UpstreamCall("chat", body, "m", 50)
    path, sent = request_body(chat, "m", "Hello", 41, "completion", lambda _: "<user>hi")
    assert path == "/v1/completions" and sent["logprobs"] == 2  # completions' own field
    assert sent["prompt"] == "<user>hiHello"
    # Asked again from the start (restart-and-skip), the body is the client's as sent.
    assert request_body(chat, "m", "", 50)[1] == body | {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
    }
