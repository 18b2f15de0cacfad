"""An instance of a JSON schema, chosen by a seed: the sim engine's tool arguments, and
the example call the generic prompt shows the model.

Covers what function schemas use: objects (required properties always, optional ones by
the seed), strings (length bounds, a few formats), enums and consts, integers and
numbers within their bounds and steps, booleans, null, arrays (item schemas, tuple
items, length bounds), nesting, local ``$ref`` (``#/$defs/...``, ``#/definitions/...``,
``#``), ``anyOf``/``oneOf`` (one branch) and ``allOf`` (merged, simply).  A string
``pattern`` is not followed (no regex inversion here); such a schema gets a plain word.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

_WORDS = ("river", "gate", "water", "stream", "flow", "token", "queue", "batch", "reader")
_FORMATS = {
    "date": "2026-01-31",
    "date-time": "2026-01-31T12:00:00Z",
    "time": "12:00:00",
    "email": "reader@example.com",
    "uri": "https://example.com/gate",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "192.0.2.1",
}
#: Past this depth of nesting, only what is required (recursive schemas end).
_MAX_DEPTH = 6


def example_instance(schema: Mapping[str, Any] | bool, seed: int) -> Any:
    """A value valid for ``schema``, the same for the same seed."""
    root = schema if isinstance(schema, Mapping) else {}
    return _Example(root, random.Random(seed)).value(schema, 0)


class _Example:
    def __init__(self, root: Mapping[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def value(self, schema: Mapping[str, Any] | bool, depth: int) -> Any:
        if schema is True or schema == {}:
            return self.rng.choice(_WORDS)
        if not isinstance(schema, Mapping):
            return None
        if "$ref" in schema:
            return self.value(self.resolve(schema["$ref"]), depth + 1)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return self.rng.choice(list(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = list(schema[key])
                branch = options[0] if depth >= _MAX_DEPTH else self.rng.choice(options)
                return self.value(self.merged(schema, key, branch), depth + 1)
        if "allOf" in schema:
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = self.resolve(part["$ref"]) if "$ref" in part else part
                merged = _merge(merged, part)
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"] or ["null"]
            kind = self.rng.choice(kinds)
        if kind is None:
            kind = _implied_type(schema)
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "string":
            return self.string(schema)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self.rng.choice(_WORDS)

    def resolve(self, ref: str) -> Mapping[str, Any]:
        if ref == "#":
            return self.root
        node: Any = self.root
        for part in ref.removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        if not isinstance(node, Mapping):
            raise ValueError(f"$ref {ref!r} is not a schema")
        return node

    def merged(self, schema: Mapping[str, Any], key: str, branch: Any) -> Any:
        """A branch with the keywords beside its ``anyOf`` (a ``type`` shared by all)."""
        rest = {k: v for k, v in schema.items() if k not in (key, "description", "title")}
        if not rest or not isinstance(branch, Mapping):
            return branch
        if "$ref" in branch:
            branch = self.resolve(branch["$ref"])
        return _merge(rest, branch)

    def object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        properties: Mapping[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", ()))
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            if name in required or (depth < _MAX_DEPTH and self.rng.random() < 0.5):
                out[name] = self.value(sub, depth + 1)
        for name in required - set(out):
            out[name] = self.rng.choice(_WORDS)  # required but not described
        minimum = int(schema.get("minProperties", 0))
        extra = schema.get("additionalProperties", True)
        while len(out) < minimum and extra is not False:
            out[f"{self.rng.choice(_WORDS)}_{len(out)}"] = self.value(
                extra if isinstance(extra, Mapping) else {"type": "string"}, depth + 1
            )
        return out

    def array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = list(schema.get("prefixItems", ()))
        items = schema.get("items", {"type": "string"})
        if isinstance(items, list):  # draft-4 tuple
            prefix, items = items, schema.get("additionalItems", {"type": "string"})
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, 2)))
        count = low if depth >= _MAX_DEPTH else self.rng.randint(max(low, min(1, high)), high)
        count = max(count, min(len(prefix), high))
        out = [self.value(prefix[i], depth + 1) for i in range(min(count, len(prefix)))]
        item_schema = items if items is not False else {}
        while len(out) < count:
            value = self.value(item_schema, depth + 1)
            if schema.get("uniqueItems"):
                for _ in range(16):  # another draw, for an item not yet there
                    if value not in out:
                        break
                    value = self.value(item_schema, depth + 1)
                else:
                    break
            out.append(value)
        return out

    def string(self, schema: Mapping[str, Any]) -> str:
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMATS:
            return _FORMATS[fmt]
        low = int(schema.get("minLength", 0))
        high = int(schema.get("maxLength", max(low, 24)))
        text = self.rng.choice(_WORDS)
        while len(text) < low:
            text += " " + self.rng.choice(_WORDS)
        return text[:high] if len(text) > high else text

    def integer(self, schema: Mapping[str, Any]) -> int:
        low, high = _bounds(schema, nudge=1)
        first, last = math.ceil(low), math.floor(high)
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            first, last = math.ceil(first / step), math.floor(last / step)
            return step * self.rng.randint(first, max(first, last))
        return self.rng.randint(first, max(first, last))

    def number(self, schema: Mapping[str, Any]) -> float | int:
        low, high = _bounds(schema, nudge=0.01)
        step = schema.get("multipleOf")
        if isinstance(step, int | float) and step > 0:
            first, last = math.ceil(low / step), math.floor(high / step)
            # A multiple whose quotient is exact in floating point (validators divide).
            for _ in range(16):
                value = self.rng.randint(first, max(first, last)) * step
                if float(value / step).is_integer():
                    return int(value) if float(value).is_integer() else value
            return first * step
        value = round(self.rng.uniform(low, high), 2)
        return min(max(value, low), high)


def _bounds(schema: Mapping[str, Any], *, nudge: float) -> tuple[float, float]:
    """The closed range a number may take (0 to 100 where none is set); an exclusive
    bound moves in by ``nudge``."""
    low: float | None = _number(schema.get("minimum"))
    high: float | None = _number(schema.get("maximum"))
    exclusive_low = _number(schema.get("exclusiveMinimum"))
    exclusive_high = _number(schema.get("exclusiveMaximum"))
    if exclusive_low is not None:
        low = exclusive_low + nudge
    if exclusive_high is not None:
        high = exclusive_high - nudge
    if low is None and high is None:
        return 0, 100
    if low is None:
        assert high is not None
        return high - 100, high
    return low, low + 100 if high is None else high


def _number(value: Any) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _implied_type(schema: Mapping[str, Any]) -> str | None:
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    if "minimum" in schema or "maximum" in schema:
        return "number"
    if "minLength" in schema or "maxLength" in schema or "format" in schema:
        return "string"
    return None


def _merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Two schemas' keywords together (properties and required united)."""
    out = {**base, **extra}
    if "properties" in base and "properties" in extra:
        out["properties"] = {**base["properties"], **extra["properties"]}
    if "required" in base and "required" in extra:
        more = [name for name in extra["required"] if name not in base["required"]]
        out["required"] = [*base["required"], *more]
    return out
