"""tools/example.py: an instance of a JSON schema from a seed, valid for it."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from sluicegate.tools.example import example_instance
from tests.tools.support import TOOLS

SCHEMAS: list[dict[str, Any]] = [
    *(tool["function"]["parameters"] for tool in TOOLS),
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "when": {"type": "string", "format": "date-time"},
            "name": {"type": "string", "minLength": 12, "maxLength": 20},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "maybe": {"type": ["integer", "null"], "exclusiveMinimum": 0, "exclusiveMaximum": 3},
            "price": {"type": "number", "minimum": 0.5, "maximum": 0.75},
            "step": {"type": "number", "multipleOf": 0.1, "minimum": 0, "maximum": 2},
            "count": {"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 22},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 2,
                "maxItems": 3,
                "uniqueItems": True,
            },
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"const": "x"}]},
            "nested": {
                "type": "object",
                "properties": {
                    "deeper": {
                        "type": "object",
                        "properties": {"v": {"type": "integer"}},
                        "required": ["v"],
                    }
                },
                "required": ["deeper"],
            },
        },
        "required": [
            "id",
            "when",
            "name",
            "flag",
            "nothing",
            "maybe",
            "price",
            "step",
            "count",
            "tags",
            "pair",
            "nested",
        ],
    },
    {
        # Pydantic's shape: $defs, $ref, anyOf with null, allOf.
        "$defs": {
            "Item": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
            },
            "Node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            },
        },
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "tree": {"$ref": "#/$defs/Node"},
            "both": {
                "allOf": [{"$ref": "#/$defs/Item"}, {"properties": {"extra": {"type": "boolean"}}}]
            },
        },
        "required": ["items", "note", "tree", "both"],
    },
    {"type": "object", "properties": {}},
    {"type": "object", "minProperties": 2},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_instances_validate(schema: dict[str, Any]) -> None:
    for seed in range(40):
        jsonschema.validate(example_instance(schema, seed), schema)


def test_same_seed_same_instance_and_seeds_vary() -> None:
    schema = SCHEMAS[2]
    assert example_instance(schema, 3) == example_instance(schema, 3)
    assert len({repr(example_instance(schema, seed)) for seed in range(10)}) > 1
