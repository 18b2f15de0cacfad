"""tools/grammar.py: llguidance accepts exactly the well-formed calls (byte-level tokens,
so every byte is checked)."""

from __future__ import annotations

import pytest

from sluicegate.tools.grammar import MAX_CALLS, tool_grammar
from sluicegate.tools.spec import tool_plan
from tests.tools.support import TOOLS, accepts

WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'  # noqa: E501
ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 0.5}}</tool_call>'


def grammar(choice: object, parallel: bool | None = None) -> str:
    plan = tool_plan(TOOLS, choice, parallel)
    assert plan is not None
    built = tool_grammar(plan)
    assert built is not None
    return built


def test_none_has_no_grammar() -> None:
    plan = tool_plan(TOOLS, "none", None)
    assert plan is not None
    assert tool_grammar(plan) is None


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (WEATHER_CALL, True),
        (ADD_CALL, True),
        (f"{WEATHER_CALL}\n{ADD_CALL}", True),
        ("It is sunny.", False),  # required: no text
        ("", False),
        (WEATHER_CALL.replace("get_weather", "get_wether"), False),  # not a tool
        (WEATHER_CALL.replace(', "unit": "celsius"', ""), False),  # a required field missing
        (WEATHER_CALL.replace("celsius", "kelvin"), False),  # not in the enum
        (ADD_CALL.replace('"b": 0.5', '"b": 0.5, "c": 1'), False),  # no other properties
        (ADD_CALL.replace("2", "99999999999999999999"), False),  # past 64 bits
        (ADD_CALL.replace('"a": 2', '"a":2'), False),  # compact JSON, one way only
        (f"{WEATHER_CALL}\n", False),  # nothing after the last call
        (f"{WEATHER_CALL} and more", False),
    ],
)
def test_required(text: str, ok: bool) -> None:
    assert accepts(grammar("required"), text) is ok


def test_required_without_parallel_is_one_call() -> None:
    assert accepts(grammar("required", False), WEATHER_CALL)
    assert not accepts(grammar("required", False), f"{WEATHER_CALL}\n{ADD_CALL}")


def test_at_most_max_calls() -> None:
    g = grammar("required")
    assert accepts(g, "\n".join([ADD_CALL] * MAX_CALLS))
    assert not accepts(g, "\n".join([ADD_CALL] * (MAX_CALLS + 1)))


def test_named_calls_that_function_only() -> None:
    g = grammar({"type": "function", "function": {"name": "add"}})
    assert accepts(g, ADD_CALL)
    assert not accepts(g, WEATHER_CALL)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("It is sunny in Paris.", True),
        ("Line one.\n<tool_call> is only text here", True),
        (WEATHER_CALL, True),
        (" leading space", False),
        ("<b>bold</b>", False),  # text cannot begin like a call
        (WEATHER_CALL.replace("Paris", "Paris, 12345678901234567890"), True),  # a string
    ],
)
def test_auto_text_or_calls(text: str, ok: bool) -> None:
    assert accepts(grammar("auto"), text) is ok


def test_auto_with_a_json_response_format() -> None:
    plan = tool_plan(TOOLS, "auto", None)
    assert plan is not None
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }
    g = tool_grammar(plan, schema)
    assert g is not None
    assert accepts(g, '{"answer": "sunny"}')
    assert accepts(g, ADD_CALL)
    assert not accepts(g, "sunny")
