"""tools/schema.py: numbers stay in 64-bit range wherever a schema leaves them open, and
the response_format grammar uses the same bounds."""

from __future__ import annotations

from typing import Any

import pytest

from sluicegate.engine.grammar import grammar_for_response_format
from sluicegate.tools.schema import NUMBER_BOUND, bounded_schema, schema_grammar
from tests.tools.support import accepts

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_open_integers_and_numbers_get_bounds() -> None:
    out = bounded_schema({"type": "object", "properties": {"n": {"type": "number"}}})
    n = out["properties"]["n"]
    assert (n["minimum"], n["maximum"], n["multipleOf"]) == (-NUMBER_BOUND, NUMBER_BOUND, 1e-9)


def test_bounds_the_schema_sets_are_kept() -> None:
    out = bounded_schema({"type": "integer", "minimum": 5, "exclusiveMaximum": 10})
    assert out == {"type": "integer", "minimum": 5, "exclusiveMaximum": 10}


def test_closed_objects_only_for_tools() -> None:
    assert bounded_schema(PERSON, closed_objects=True)["additionalProperties"] is False
    assert bounded_schema(PERSON)["additionalProperties"] == {"$ref": "#/$defs/sluicegate_any"}


def test_the_input_is_not_changed() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bounded_schema(schema, closed_objects=True)
    assert schema == {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"name": "Ann", "age": 41}', True),
        ('{"name": "Ann", "age": -9000000000000000000}', True),
        ('{"name": "Ann", "age": 17349773888988888888}', False),
        ('{"name": "Ann", "age": 123456789012345678901234567890}', False),
    ],
)
def test_response_format_integers_are_64_bit(text: str, ok: bool) -> None:
    grammar = grammar_for_response_format(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    )
    assert grammar is not None
    assert accepts(grammar, text) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("1.5", True),
        ("-0.000000001", True),
        ("0.1234567891", False),
        ("12345678901234567890.5", False),
        ('[1, 2.25, {"deep": 3}]', True),
        ("[1, 99999999999999999999]", False),
        ('{"x": 0.33333333333333333}', False),
    ],
)
def test_values_left_open_are_bounded_too(value: str, ok: bool) -> None:
    """``json_object`` and properties of any type: numbers inside any JSON value."""
    grammar = grammar_for_response_format({"type": "json_object"})
    assert grammar is not None
    assert accepts(grammar, f'{{"v": {value}}}') is ok


def test_refs_and_any_of_are_walked() -> None:
    schema = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"anyOf": [{"type": "integer"}, {}]}},
        "$defs": {"P": {"type": "array", "items": {"type": "number"}}},
    }
    grammar = schema_grammar(bounded_schema(schema))
    assert accepts(grammar, '{"p": [1.5, 2], "q": 7}')
    assert not accepts(grammar, '{"p": [100000000000000000000], "q": 7}')
    assert not accepts(grammar, '{"p": [], "q": 100000000000000000000}')
