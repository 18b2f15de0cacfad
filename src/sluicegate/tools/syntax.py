"""The generic tool-call syntax: what the model writes to call a tool, and how a tool's
result is shown to it.

A call is one line::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

several calls are several such lines, one after another, and an answer that calls
tools holds nothing else.  The shape is Hermes's (Qwen and many fine-tunes were trained
on it); what is ours is that it is exact: the keys in that order, JSON written compactly
(``", "`` and ``": "``), no whitespace around the JSON.  A parser can then read it while
it streams without guessing, and a grammar can force it byte for byte.

A result goes back in the user's turn, one block per result::

    <tool_response name="get_weather" id="call_...">
    {"temperature": 21}
    </tool_response>
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
#: Between two calls of one answer.
CALL_SEPARATOR = "\n"
#: The format's name in ``SamplingParams.tool_format`` (journaled with the request).
GENERIC = "generic"


def dump_json(value: Any) -> str:
    """JSON as the grammar writes it (compact, ``", "`` and ``": "``, ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def call_head(name: str) -> str:
    """A call's text up to its arguments."""
    return f'{CALL_OPEN}{{"name": {dump_json(name)}, "arguments": '


def call_tail() -> str:
    """A call's text after its arguments."""
    return "}" + CALL_CLOSE


def call_text(name: str, arguments: str) -> str:
    """One call, its ``arguments`` already JSON text."""
    return call_head(name) + arguments + call_tail()


def result_text(name: str, call_id: str, content: str) -> str:
    """One tool result as the model is shown it."""
    return (
        f"<tool_response name={dump_json(name)} id={dump_json(call_id)}>\n"
        f"{content}\n</tool_response>"
    )
