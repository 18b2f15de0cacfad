"""What a request's ``tools`` and ``tool_choice`` ask for, checked, as a small frozen plan.

OpenAI's shapes: ``tools`` (``{"type": "function", "function": {"name", "description",
"parameters", "strict"}}``), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls``
(default true), and the legacy ``functions`` / ``function_call``, which are read as the
same tools (the answer comes back as ``tool_calls`` either way).  Every problem is a 400
naming the parameter; a schema llguidance cannot enforce is one too, found here rather
than when the first token is sampled.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluicegate.errors import APIError, invalid_param
from sluicegate.tools.schema import SchemaError, bounded_schema, schema_grammar

#: OpenAI's rule for function names.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: The most tools one request may offer.
MAX_TOOLS = 128
#: What a function without ``parameters`` takes: nothing.
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


class ToolChoice(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    #: One function, named in ``ToolPlan.named``.
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """One function a request offers."""

    name: str
    description: str
    #: Its JSON schema, as the client sent it (what answers are validated against).
    parameters: Mapping[str, Any]
    #: The schema the grammar enforces (:func:`~sluicegate.tools.schema.bounded_schema`).
    bounded_parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The tools of a request and what it asks of the model."""

    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    #: The function ``tool_choice`` names (``choice`` is ``NAMED``).
    named: str | None = None
    #: Several calls per answer allowed (``parallel_tool_calls``).
    parallel: bool = True

    @property
    def callable(self) -> tuple[ToolFunction, ...]:
        """The functions the model may call now (none under ``"none"``)."""
        if self.choice == ToolChoice.NONE:
            return ()
        if self.choice == ToolChoice.NAMED:
            return tuple(f for f in self.functions if f.name == self.named)
        return self.functions

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (``required`` or a named function)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)


def tool_plan(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    functions: list[Any] | None = None,
    function_call: Any = None,
) -> ToolPlan | None:
    """The plan of a chat request's tool fields (None: it offers no tools)."""
    if tools is not None and functions is not None:
        raise invalid_param("functions", "send 'tools' or the legacy 'functions', not both")
    if functions is not None:
        if tool_choice is not None:
            raise invalid_param("tool_choice", "tool_choice goes with 'tools', not 'functions'")
        offered = [_function(item, f"functions[{i}]") for i, item in enumerate(functions)]
        choice_param, choice = "function_call", function_call
    else:
        offered = [_tool(item, f"tools[{i}]") for i, item in enumerate(tools or [])]
        choice_param, choice = "tool_choice", tool_choice
    if not offered:
        if choice is not None:
            raise invalid_param(
                choice_param,
                f"'{choice_param}' is only allowed when tools are given "
                f"({'functions' if functions is not None else 'tools'} is empty or missing)",
            )
        return None
    if len(offered) > MAX_TOOLS:
        raise invalid_param(
            "tools", f"at most {MAX_TOOLS} tools may be offered; got {len(offered)}"
        )
    seen: set[str] = set()
    for function in offered:
        if function.name in seen:
            raise invalid_param(
                "tools", f"tool names must be unique; '{function.name}' is given twice"
            )
        seen.add(function.name)
    kind, named = _choice(choice, choice_param, seen)
    return ToolPlan(tuple(offered), kind, named, parallel_tool_calls is not False)


def _tool(item: Any, where: str) -> ToolFunction:
    if not isinstance(item, Mapping):
        raise invalid_param(where, f"each tool must be an object; got {item!r}")
    kind = item.get("type", "function")
    if kind != "function":
        raise APIError(
            400,
            f"'{where}.type' must be 'function' (this server calls functions only); got {kind!r}",
            param=f"{where}.type",
            code="unsupported_parameter",
        )
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise invalid_param(f"{where}.function", f"'{where}.function' must be an object")
    return _function(function, f"{where}.function")


def _function(item: Any, where: str) -> ToolFunction:
    if not isinstance(item, Mapping):
        raise invalid_param(where, f"'{where}' must be an object; got {item!r}")
    name = item.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise invalid_param(
            f"{where}.name",
            f"'{where}.name' must be 1 to 64 letters, digits, underscores or dashes "
            f"(^[a-zA-Z0-9_-]{{1,64}}$); got {name!r}",
        )
    description = item.get("description") or ""
    if not isinstance(description, str):
        raise invalid_param(f"{where}.description", f"'{where}.description' must be a string")
    parameters = item.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise invalid_param(
            f"{where}.parameters",
            f"'{where}.parameters' must be a JSON schema object; got {parameters!r}",
        )
    if "type" in parameters and parameters["type"] != "object":
        raise invalid_param(
            f"{where}.parameters",
            f"'{where}.parameters' must describe an object (type 'object'); "
            f"got type {parameters['type']!r}",
        )
    strict = item.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param(f"{where}.strict", f"'{where}.strict' must be a boolean")
    bounded = bounded_schema({"type": "object", **parameters}, closed_objects=True)
    try:
        schema_grammar(bounded)
    except SchemaError as exc:
        raise invalid_param(f"{where}.parameters", f"'{where}.parameters': {exc}") from None
    return ToolFunction(name, description, parameters, bounded)


def _choice(choice: Any, param: str, names: set[str]) -> tuple[ToolChoice, str | None]:
    if choice is None:
        return ToolChoice.AUTO, None
    if isinstance(choice, str):
        if choice in ("none", "auto", "required"):
            return ToolChoice(choice), None
        raise invalid_param(
            param, f"'{param}' must be 'none', 'auto', 'required' or a function; got {choice!r}"
        )
    if isinstance(choice, Mapping):
        # {"type": "function", "function": {"name": ...}}; legacy function_call: {"name": ...}
        function = choice.get("function", choice)
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in names:
                offered = ", ".join(f"'{n}'" for n in sorted(names))
                raise invalid_param(
                    param,
                    f"'{param}' names the function '{name}', which is not among the "
                    f"tools given ({offered})",
                )
            return ToolChoice.NAMED, name
    raise invalid_param(
        param,
        f"'{param}' must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}',
    )
