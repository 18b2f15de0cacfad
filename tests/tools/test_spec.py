"""tools/spec.py: a request's tool fields become a plan, or a 400 naming what is wrong."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sluicegate.errors import APIError
from sluicegate.tools.spec import ToolChoice, tool_plan
from tests.tools.support import ADD, TOOLS, WEATHER


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        tool_plan(
            fields.get("tools"),
            fields.get("tool_choice"),
            fields.get("parallel_tool_calls"),
            fields.get("functions"),
            fields.get("function_call"),
        )
    assert info.value.status_code == 400
    return info.value


def test_no_tools_no_plan() -> None:
    assert tool_plan(None, None, None) is None


def test_defaults_auto_and_parallel() -> None:
    plan = tool_plan(TOOLS, None, None)
    assert plan is not None
    assert plan.choice == ToolChoice.AUTO
    assert plan.parallel
    assert [f.name for f in plan.callable] == ["get_weather", "add"]
    assert not plan.forced


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_string_choices(choice: str) -> None:
    plan = tool_plan(TOOLS, choice, False)
    assert plan is not None
    assert plan.choice == ToolChoice(choice)
    assert not plan.parallel
    assert plan.callable == (() if choice == "none" else plan.functions)


def test_named_choice_keeps_that_function_only() -> None:
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert plan is not None
    assert plan.choice == ToolChoice.NAMED
    assert plan.forced
    assert [f.name for f in plan.callable] == ["add"]


def test_legacy_functions_are_tools() -> None:
    plan = tool_plan(None, None, None, [ADD["function"]], {"name": "add"})
    assert plan is not None
    assert plan.choice == ToolChoice.NAMED
    assert plan.named == "add"
    assert tool_plan(None, None, None, [ADD["function"]], "none") is not None


def test_unknown_named_function() -> None:
    error = refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert error.param == "tool_choice"
    assert "'nope'" in error.message
    assert "'add', 'get_weather'" in error.message


@pytest.mark.parametrize("name", ["", "has space", "x" * 65, "dot.name", 7])
def test_bad_names(name: Any) -> None:
    tool = copy.deepcopy(WEATHER)
    tool["function"]["name"] = name
    error = refused(tools=[tool])
    assert error.param == "tools[0].function.name"
    assert "^[a-zA-Z0-9_-]{1,64}$" in error.message


@pytest.mark.parametrize("parameters", [[], "object", {"type": "string"}])
def test_parameters_must_be_an_object_schema(parameters: Any) -> None:
    tool = copy.deepcopy(ADD)
    tool["function"]["parameters"] = parameters
    error = refused(tools=[WEATHER, tool])
    assert error.param == "tools[1].function.parameters"


def test_invalid_schema_is_found_by_llguidance() -> None:
    tool = copy.deepcopy(ADD)
    tool["function"]["parameters"]["properties"]["a"] = {"type": "integr"}
    error = refused(tools=[tool])
    assert error.param == "tools[0].function.parameters"
    assert "integr" in error.message


def test_duplicate_names() -> None:
    error = refused(tools=[ADD, WEATHER, ADD])
    assert error.param == "tools"
    assert "'add' is given twice" in error.message


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_tool_choice_without_tools(choice: str) -> None:
    assert refused(tool_choice=choice).param == "tool_choice"
    assert refused(tools=[], tool_choice=choice).param == "tool_choice"


@pytest.mark.parametrize(
    "choice", ["always", {"type": "function"}, {"type": "allowed_tools", "tools": []}, 3]
)
def test_bad_tool_choice(choice: Any) -> None:
    assert refused(tools=TOOLS, tool_choice=choice).param == "tool_choice"


def test_tools_and_functions_together() -> None:
    assert refused(tools=TOOLS, functions=[ADD["function"]]).param == "functions"


def test_only_function_tools() -> None:
    error = refused(tools=[{"type": "code_interpreter"}])
    assert error.param == "tools[0].type"
    assert error.code == "unsupported_parameter"


def test_function_without_parameters_takes_an_empty_object() -> None:
    plan = tool_plan([{"type": "function", "function": {"name": "now"}}], "required", None)
    assert plan is not None
    assert plan.functions[0].parameters == {"type": "object", "properties": {}}
