"""JSON schemas as the model may write them: compact JSON, numbers in 64-bit range.

A schema says what is *valid*; a grammar compiled from it says what the model may
*write*, and nothing obliges the two to be equal: any narrowing of what may be written
still yields valid answers.  Two narrowings matter for a small model sampled at a warm
temperature:

- **Numbers are bounded.**  An integer the schema does not bound gets
  ``|n| <= 9·10^18`` (inside a signed 64-bit integer; llguidance compiles bounds through
  doubles, and ``2^63 - 1`` is not one), and a number also gets at most nine decimals
  (``multipleOf: 1e-9``, the finest step llguidance compiles exactly).  Without them a
  sampled ``17349773888988888...`` never ends until ``max_tokens`` cuts it.  The same
  applies to values the schema leaves open (``{}``, an object's unnamed properties, an
  array's untyped items): they become :data:`ANY_VALUE`, any JSON value with bounded
  numbers.
- **Tool arguments are closed** (``closed_objects``): an object that names its
  properties and says nothing of others gets ``additionalProperties: false``, so the
  model fills in the fields asked for instead of inventing more.

JSON is written on one line with ``", "`` and ``": "`` between items
(:data:`JSON_STYLE`), the way models write it; free whitespace lets a model loop on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:  # a type of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

#: llguidance's JSON options: compact JSON, single spaces after separators.
JSON_STYLE: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
#: Integers and numbers stay within this magnitude where the schema sets no bound.
NUMBER_BOUND = 9 * 10**18
#: A number's step where the schema sets none: at most nine decimals.
NUMBER_STEP = 1e-9
ANY_DEF = "sluicegate_any"
ANY_REF = f"#/$defs/{ANY_DEF}"

#: Any JSON value, its numbers bounded (the stand-in for schemas that allow anything).
ANY_VALUE: dict[str, Any] = {
    "anyOf": [
        {"type": "null"},
        {"type": "boolean"},
        {"type": "integer", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND},
        {
            "type": "number",
            "minimum": -NUMBER_BOUND,
            "maximum": NUMBER_BOUND,
            "multipleOf": NUMBER_STEP,
        },
        {"type": "string"},
        {"type": "array", "items": {"$ref": ANY_REF}},
        {"type": "object", "additionalProperties": {"$ref": ANY_REF}},
    ]
}

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
#: Keywords that constrain nothing: a schema with only these allows any value.
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "x-guidance",
    }
)


class SchemaError(ValueError):
    """A JSON schema llguidance cannot enforce (the message says why)."""


def bounded_schema(schema: Mapping[str, Any], *, closed_objects: bool = False) -> dict[str, Any]:
    """``schema`` narrowed as the module describes (a new dict; ``schema`` is not
    changed)."""
    walker = _Bounder(closed_objects)
    out = walker.bound(dict(schema))
    if not isinstance(out, dict):  # pragma: no cover - a mapping stays a mapping
        raise SchemaError("a JSON schema must be an object")
    if walker.uses_any:
        out = dict(out)
        out["$defs"] = {**out.get("$defs", {}), ANY_DEF: ANY_VALUE}
    return out


def styled(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A (bounded) schema with :data:`JSON_STYLE` attached, for a lark ``%json``."""
    return {**schema, "x-guidance": dict(JSON_STYLE)}


def schema_grammar(schema: Mapping[str, Any]) -> str:
    """The llguidance grammar of a bounded schema; raises :class:`SchemaError` naming
    what llguidance cannot enforce."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_STYLE
        )
    except ValueError as exc:
        raise SchemaError(f"invalid JSON schema: {exc}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise SchemaError(f"invalid JSON schema: {problem}")
    return grammar


class _Bounder:
    def __init__(self, closed_objects: bool) -> None:
        self.closed_objects = closed_objects
        self.uses_any = False

    def any_value(self) -> dict[str, Any]:
        self.uses_any = True
        return {"$ref": ANY_REF}

    def bound(self, node: Any) -> Any:
        if node is True:
            return self.any_value()
        if not isinstance(node, Mapping):
            return node
        if set(node) <= _ANNOTATIONS:
            return self.any_value()
        out = dict(node)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), Mapping):
                out[key] = {name: self.bound(sub) for name, sub in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [self.bound(sub) for sub in out[key]]
        for key in _SCHEMA_ONE:
            value = out.get(key)
            if isinstance(value, list):  # draft-4 tuple items
                out[key] = [self.bound(sub) for sub in value]
            elif value is True or isinstance(value, Mapping):
                out[key] = self.bound(value)
        kinds = out.get("type")
        types = {kinds} if isinstance(kinds, str) else set(kinds or ())
        if types & {"integer", "number"}:
            if "minimum" not in out and "exclusiveMinimum" not in out:
                out["minimum"] = -NUMBER_BOUND
            if "maximum" not in out and "exclusiveMaximum" not in out:
                out["maximum"] = NUMBER_BOUND
            if "number" in types and "multipleOf" not in out:
                out["multipleOf"] = NUMBER_STEP
        if "object" in types and "additionalProperties" not in out:
            if self.closed_objects and "properties" in out:
                out["additionalProperties"] = False
            elif "patternProperties" not in out:
                out["additionalProperties"] = self.any_value()
        if "array" in types and "items" not in out and "prefixItems" not in out:
            out["items"] = self.any_value()
        return out
