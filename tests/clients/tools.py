"""What the client tests offer the server: tools as OpenAI's wire format spells them, the
pydantic models that clients turn into tools, and the checks an answer must pass.

The schemas carry the constraints clients rely on (enums, bounds, required keys, no extra
keys, bounded arrays): an answer that parses as JSON but breaks one of them is exactly
what makes instructor retry and pydantic-ai give up, so every check validates against
the schema that was sent, not only that the arguments parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, Field

#: The sim engine's model name (``sluicegate serve --engine sim``).
SIM_MODEL = "sluicegate-sim"

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {
                "timezone": {"type": "string"},
                "hour_format": {"type": "integer", "minimum": 12, "maximum": 24},
            },
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS
}

ASK_WEATHER: list[dict[str, Any]] = [
    {"role": "system", "content": "You answer with the tools you are given."},
    {"role": "user", "content": "What is the weather in Paris, in celsius?"},
]


class Weather(BaseModel):
    """The weather to look up: a city and the unit to answer in."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int = Field(ge=0, le=150)
    languages: list[str] = Field(max_length=3)


class Trip(BaseModel):
    """A trip: where, how long, and who goes."""

    destination: str
    nights: int = Field(ge=1, le=30)
    travellers: list[Person] = Field(min_length=1, max_length=2)


def check_arguments(schema: Mapping[str, Any], arguments: str) -> dict[str, Any]:
    """``arguments`` (a tool call's JSON text) parsed and validated against ``schema``."""
    value = json.loads(arguments)
    assert isinstance(value, dict), f"arguments are not a JSON object: {arguments!r}"
    jsonschema.Draft202012Validator(schema).validate(value)
    return value


def check_call(name: str, arguments: str) -> dict[str, Any]:
    """A call to one of :data:`TOOLS`: its name is offered and its arguments fit."""
    assert name in TOOL_SCHEMAS, f"called {name!r}, offered {sorted(TOOL_SCHEMAS)}"
    return check_arguments(TOOL_SCHEMAS[name], arguments)


def assemble_streamed_calls(deltas: Iterable[Any]) -> dict[int, dict[str, Any]]:
    """Streamed ``delta.tool_calls`` entries (the openai client's objects) joined by
    ``index`` as OpenAI documents them: the first fragment of a call carries its ``id``,
    ``type`` and ``function.name``; every fragment may add to ``function.arguments``."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            assert delta.id, f"the first fragment of call {delta.index} has no id"
            assert delta.type == "function"
            assert delta.function is not None and delta.function.name
            call = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index] = call
        else:
            # Later fragments add arguments only; a repeated name would be appended to
            # the first by clients that concatenate every field (LangChain does).
            assert not (delta.function and delta.function.name), "a name in a later fragment"
        if delta.function is not None and delta.function.arguments:
            call["arguments"] += delta.function.arguments
    return calls


def tool_result_turn(
    messages: list[dict[str, Any]], calls: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` followed by the assistant's ``calls`` (``id``, ``name``, ``arguments``)
    and one ``role: "tool"`` answer to each: the second turn every agent loop sends."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'}
        for call in calls
    ]
    return [*messages, assistant, *results]
