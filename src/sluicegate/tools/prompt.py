"""Tools, calls and their results in the prompt: history is never dropped.

A chat template that knows tools (it reads a ``tools`` variable, as Qwen's and Hermes's
do) renders them itself: it is given the callable tools and the messages with their
``tool_calls`` (arguments as objects, the Hugging Face convention) and ``role: "tool"``
turns.  A template that does not (SmolLM2's) gets the **generic format**, in plain
turns it can render:

- a system message describing the tools (name, description, JSON schema), the exact
  call syntax (:mod:`~sluicegate.tools.syntax`) and an example call valid for the first
  tool's schema; under ``none`` no tool is described as callable;
- an assistant turn that called tools: its text, then its calls in that same syntax;
- tool results (``role: "tool"``, legacy ``"function"``): a user turn of
  ``<tool_response>`` blocks naming each result's function and call id (consecutive
  results share one turn).

The legacy ``function_call`` of an assistant turn is one call like the others.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sluicegate.errors import invalid_param
from sluicegate.tools.example import example_instance
from sluicegate.tools.spec import ToolChoice, ToolPlan
from sluicegate.tools.syntax import CALL_SEPARATOR, call_text, dump_json, result_text

Message = dict[str, Any]


def render_messages(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None, native: bool
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """The messages a chat template renders, and the tools it is given (None: no tools,
    or the generic format, which describes them in a system message)."""
    calls = _normalized_history(messages)
    if native:
        tools = None
        if plan is not None and plan.callable:
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": f.name,
                        "description": f.description,
                        "parameters": dict(f.parameters),
                    },
                }
                for f in plan.callable
            ]
        return calls, tools
    rendered = _generic_history(calls)
    if plan is not None and plan.callable:
        rendered = _with_system(rendered, tools_system_text(plan))
    return rendered, None


def tools_system_text(plan: ToolPlan) -> str:
    """The generic format's description of the callable tools and how to call them."""
    functions = plan.callable
    lines = ["You can call these tools:"]
    for function in functions:
        lines.append("")
        described = f": {function.description}" if function.description else ""
        lines.append(f"Tool {function.name}{described}")
        lines.append(f"Arguments (JSON schema): {dump_json(dict(function.parameters))}")
    first = functions[0]
    example = call_text(first.name, dump_json(example_instance(first.parameters, 0)))
    lines += ["", "To call a tool, write exactly one line like this, and nothing else:", example]
    if plan.parallel and plan.choice != ToolChoice.NAMED:
        lines.append("For several calls, write one such line per call.")
    if plan.choice == ToolChoice.AUTO:
        lines.append("Call a tool when it helps; otherwise answer in plain text.")
    elif plan.choice == ToolChoice.NAMED:
        lines.append(f"Now call {first.name}.")
    else:
        lines.append("Now answer with tool calls only.")
    lines.append("Results come back in <tool_response> blocks.")
    return "\n".join(lines)


def _with_system(messages: list[Message], text: str) -> list[Message]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _normalized_history(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Messages in the current shape: legacy ``function_call`` turns as ``tool_calls``,
    ``function`` results as ``tool`` turns, every call checked (a 400 names the bad one),
    arguments parsed to objects where they are JSON."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        copy: Message = {k: v for k, v in message.items() if v is not None}
        role = copy["role"]
        if role == "assistant":
            raw = copy.pop("tool_calls", None)
            legacy = copy.pop("function_call", None)
            if legacy is not None:
                raw = [*(raw or []), {"id": "", "type": "function", "function": legacy}]
            if raw:
                copy["tool_calls"] = [
                    _call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(raw)
                ]
        elif role == "function":
            copy["role"] = "tool"
            copy.setdefault("tool_call_id", "")
        out.append(copy)
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise invalid_param(
            where,
            f"'{where}' must be {{'id', 'type': 'function', 'function': {{'name', "
            f"'arguments'}}}}; got {call!r}",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: kept as the text it is
            arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _generic_history(messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, for the results
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            lines = [content] if content else []
            for call in message["tool_calls"]:
                function = call["function"]
                names[call["id"]] = function["name"]
                arguments = function["arguments"]
                text = arguments if isinstance(arguments, str) else dump_json(arguments)
                lines.append(call_text(function["name"], text))
            out.append({"role": "assistant", "content": CALL_SEPARATOR.join(lines)})
        elif role == "tool":
            call_id = message.get("tool_call_id") or ""
            name = message.get("name") or names.get(call_id, "")
            block = result_text(name, call_id, content)
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
