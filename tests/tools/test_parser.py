"""tools/parser.py: content and tool-call deltas from generated text, the same whatever
the split of the text into deltas."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from sluicegate.engine.output import merge_tool_call
from sluicegate.tools.parser import ToolCallParser, call_id
from sluicegate.tools.syntax import call_text

PROMPT = (1, 2, 3)
WEATHER = call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
#: Arguments whose strings hold every marker, braces and escapes.
TRICKY_ARGUMENTS = '{"note": "a }</tool_call> b \\" c \\\\", "list": [{"x": [1, 2]}, "]"]}'
TRICKY = call_text("add", TRICKY_ARGUMENTS)


def parse(pieces: list[str], seed: int = 5) -> tuple[str, list[dict[str, Any]], int]:
    """Content, whole calls (fragments merged as a client merges them) and the number
    of calls, feeding ``pieces`` one by one."""
    parser = ToolCallParser(seed, PROMPT)
    content = ""
    calls: list[dict[str, Any]] = []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        for fragment in out.tool_calls:
            merge_tool_call(calls, fragment)
    end = parser.finish()
    assert not end.tool_calls
    return content + end.content, calls, parser.num_calls


def splits(text: str, parts: int) -> list[list[str]]:
    return [
        [text[i:j] for i, j in itertools.pairwise((0, *cuts, len(text)))]
        for cuts in itertools.combinations(range(1, len(text)), parts - 1)
    ]


def test_one_call() -> None:
    content, calls, count = parse([WEATHER])
    assert content == ""
    assert count == 1
    assert calls == [
        {
            "index": 0,
            "id": call_id(5, PROMPT, 0),
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}',
            },
        }
    ]


def test_several_calls_with_markers_inside_strings() -> None:
    content, calls, count = parse([f"{WEATHER}\n{TRICKY}"])
    assert (content, count) == ("", 2)
    assert [c["index"] for c in calls] == [0, 1]
    assert calls[1]["function"]["arguments"] == TRICKY_ARGUMENTS
    assert json.loads(calls[1]["function"]["arguments"])["note"] == 'a }</tool_call> b " c \\'
    assert calls[1]["id"] == call_id(5, PROMPT, 1) != calls[0]["id"]


@pytest.mark.parametrize("parts", [2, 3])
def test_every_split_assembles_the_same(parts: int) -> None:
    text = f"{WEATHER}\n{TRICKY}"
    whole = parse([text])
    pieces_list = splits(text, parts)
    if parts == 3:
        pieces_list = pieces_list[::37]  # a spread of the ~20,000 three-way splits
    for pieces in pieces_list:
        assert parse(pieces) == whole, pieces


def test_one_character_at_a_time() -> None:
    text = f"{TRICKY}\n{WEATHER}"
    assert parse(list(text)) == parse([text])


def test_text_is_streamed_at_once() -> None:
    parser = ToolCallParser(1, PROMPT)
    assert parser.feed("Sun").content == "Sun"
    assert parser.feed("ny, <tool_call> is text here").content == "ny, <tool_call> is text here"
    assert parser.num_calls == 0


def test_only_what_may_be_a_marker_is_held() -> None:
    parser = ToolCallParser(1, PROMPT)
    assert parser.feed("<tool").content == ""  # may be a call
    assert parser.feed("box>").content == "<toolbox>"  # it was not
    parser = ToolCallParser(1, PROMPT)
    assert parser.feed('<tool_call>{"name": "add", "argu').tool_calls == []  # name unsure
    first = parser.feed('ments": {"a"').tool_calls
    assert first[0]["function"] == {"name": "add", "arguments": ""}
    assert first[1]["function"] == {"arguments": '{"a"'}  # arguments stream at once
    assert parser.feed(": 1}").tool_calls[0]["function"] == {"arguments": ": 1}"}
    assert parser.feed("}</tool_").tool_calls == []


def test_a_cut_call_keeps_what_streamed() -> None:
    content, calls, count = parse([WEATHER[: WEATHER.index("unit") + 2]])
    assert count == 1
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "un'
    assert content == ""


def test_a_cut_head_is_content() -> None:
    assert parse(['<tool_call>{"na']) == ('<tool_call>{"na', [], 0)


def test_ids_depend_on_seed_prompt_and_index() -> None:
    assert call_id(1, PROMPT, 0) == call_id(1, PROMPT, 0)
    assert (
        len(
            {
                call_id(1, PROMPT, 0),
                call_id(2, PROMPT, 0),
                call_id(1, (9,), 0),
                call_id(1, PROMPT, 1),
            }
        )
        == 4
    )


def test_a_resumed_parser_continues_the_stream() -> None:
    """Fed the delivered text silently, a new parser gives the rest of the deltas."""
    text = f"{WEATHER}\n{TRICKY}"
    _, whole, _ = parse([text])
    for cut in range(0, len(text), 7):
        first = ToolCallParser(5, PROMPT)
        calls: list[dict[str, Any]] = []
        for fragment in first.feed(text[:cut]).tool_calls:
            merge_tool_call(calls, fragment)
        resumed = ToolCallParser(5, PROMPT)
        resumed.feed(text[:cut])
        for fragment in resumed.feed(text[cut:]).tool_calls:
            merge_tool_call(calls, fragment)
        assert calls == whole, cut


def test_a_repeated_call_is_not_sent_and_ends_the_answer() -> None:
    parser = ToolCallParser(5, PROMPT)
    calls: list[dict[str, Any]] = []
    for piece in (WEATHER, "\n", WEATHER[:30], WEATHER[30:], "\n", TRICKY):
        for fragment in parser.feed(piece).tool_calls:
            merge_tool_call(calls, fragment)
    assert parser.repeated
    assert parser.finish().content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parser.num_calls == 1


def test_a_call_that_begins_like_an_earlier_one_is_held_until_it_differs() -> None:
    paris = call_text("get_weather", '{"city": "Paris"}')
    parser = ToolCallParser(5, PROMPT)
    assert len(parser.feed(paris + "\n").tool_calls) == 2  # the first streams
    # Another tool streams at once.
    assert parser.feed(TRICKY[:45]).tool_calls[0]["function"]["name"] == "add"
    parser.feed(TRICKY[45:] + "\n")
    # The same tool, arguments the same so far: held...
    assert parser.feed(paris[: paris.index("Paris")]).tool_calls == []
    # ...until they differ: then everything so far goes out, and the rest streams.
    (held,) = parser.feed("Lo").tool_calls
    assert held["function"] == {"name": "get_weather", "arguments": '{"city": "Lo'}
    assert held["index"] == 2 and held["id"] == call_id(5, PROMPT, 2)
    rest = parser.feed('ndon"}}</tool_call>').tool_calls
    assert rest == [{"index": 2, "function": {"arguments": 'ndon"}'}}]
    assert not parser.repeated and parser.num_calls == 3
