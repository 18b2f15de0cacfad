"""The grammar that holds the model to well-formed calls (llguidance's lark dialect).

- ``required``: one or more calls (exactly one without ``parallel_tool_calls``, at most
  :data:`MAX_CALLS` with it), each a line of :mod:`~sluicegate.tools.syntax` whose name
  is one of the tools and whose arguments follow that tool's schema (one ``%json`` per
  tool, an alternation over the tools: the name decides which schema the arguments
  follow).
- a named function: the same, that function only.
- ``auto``: calls as under ``required``, or text.  Text may not begin with ``<`` or
  whitespace (so that text and a call differ from the first byte, and the parser knows
  which one it reads at once); with a JSON ``response_format`` the text is that JSON
  instead.
- ``none``: no tool grammar (``response_format``'s, if any).

After the last call only end-of-sequence is allowed, so an answer that calls ends there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import llguidance

from sluicegate.tools.schema import SchemaError, bounded_schema, styled
from sluicegate.tools.spec import ToolChoice, ToolPlan
from sluicegate.tools.syntax import CALL_SEPARATOR, call_head, call_tail

#: The most calls one answer may make (``parallel_tool_calls``): a small model sampled
#: warm may otherwise repeat calls until ``max_tokens``.
MAX_CALLS = 8
#: Free text under ``auto``: anything not starting with ``<`` or whitespace.
TEXT_LEXEME = r"/[^<\s][\s\S]*/"


def tool_grammar(plan: ToolPlan, text_schema: Mapping[str, Any] | None = None) -> str | None:
    """The grammar of an answer under ``plan`` (None under ``none``).  ``text_schema``:
    under ``auto``, the JSON schema text must follow (``response_format``).  Raises
    :class:`~sluicegate.tools.schema.SchemaError` if llguidance refuses the whole."""
    if plan.choice == ToolChoice.NONE:
        return None
    lines = ["%llguidance {}"]
    if plan.choice == ToolChoice.AUTO:
        if text_schema is None:
            lines += ["start: calls | TEXT", f"TEXT: {TEXT_LEXEME}"]
        else:
            answer = json.dumps(styled(bounded_schema(text_schema)))
            lines += ["start: calls | answer", f"answer: %json{answer}"]
    else:
        lines.append("start: calls")
    separator = json.dumps(CALL_SEPARATOR)
    if plan.parallel:
        lines.append(f"calls: call ({separator} call){{0,{MAX_CALLS - 1}}}")
    else:
        lines.append("calls: call")
    functions = plan.callable
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        arguments = json.dumps(styled(function.bounded_parameters))
        head, tail = json.dumps(call_head(function.name)), json.dumps(call_tail())
        lines.append(f"call_{i}: {head} %json{arguments} {tail}")
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise SchemaError(f"the tools' grammar cannot be built: {problem}")
    return grammar
