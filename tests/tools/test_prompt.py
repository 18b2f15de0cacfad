"""tools/prompt.py: tools and the history of calls and results reach the prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluicegate.engine.tokenizer import CHATML_TEMPLATE, ChatTemplate
from sluicegate.errors import APIError
from sluicegate.tools.prompt import render_messages
from sluicegate.tools.spec import tool_plan
from sluicegate.tools.syntax import call_text
from tests.tools.support import TOOLS

#: A template that knows tools (Hermes's way, written for this test).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}"
    "{% if m['role'] == 'tool' %} ({{ m['tool_call_id'] }}){% endif %}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be useful."},
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city":"Paris","unit":"celsius"}',
                },
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "21 degrees"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
]


def render(messages: list[dict[str, Any]], choice: str = "auto", native: bool = False) -> str:
    plan = tool_plan(TOOLS, choice, None)
    rendered, tools = render_messages(messages, plan, native)
    template = ChatTemplate(TOOL_TEMPLATE if native else CHATML_TEMPLATE)
    return template.render(rendered, tools=tools)


def test_generic_history_with_calls_and_results() -> None:
    prompt = render(HISTORY)
    assert "Be useful.\n\nYou can call these tools:" in prompt  # added to the system message
    assert "Tool get_weather: The current weather in a city" in prompt
    assert '"enum": ["celsius", "fahrenheit"]' in prompt
    calls = (
        call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
        + "\n"
        + call_text("add", '{"a": 2, "b": 3}')
    )
    assert f"<|im_start|>assistant\nLet me look.\n{calls}<|im_end|>" in prompt
    results = (
        '<|im_start|>user\n<tool_response name="get_weather" id="call_a">\n21 degrees\n'
        '</tool_response>\n<tool_response name="add" id="call_b">\n5\n</tool_response><|im_end|>'
    )
    assert results in prompt  # both results in one user turn, named by their calls


def test_the_example_call_follows_the_syntax() -> None:
    prompt = render([{"role": "user", "content": "hi"}], "required")
    example = prompt.split("and nothing else:\n")[1].split("\n")[0]
    head = '<tool_call>{"name": "get_weather", "arguments": '
    assert example.startswith(head)
    assert json.loads(example[len(head) : -len("}</tool_call>")])["unit"] in (
        "celsius",
        "fahrenheit",
    )
    assert "Now answer with tool calls only." in prompt


def test_none_describes_no_tools_but_keeps_history() -> None:
    prompt = render(HISTORY, "none")
    assert "You can call these tools" not in prompt
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in prompt
    assert "21 degrees" in prompt


def test_history_without_tools_is_kept_too() -> None:
    rendered, tools = render_messages(HISTORY, None, native=False)
    assert tools is None
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert "<tool_call>" in rendered[2]["content"]


def test_legacy_function_call_and_function_role() -> None:
    messages = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "function_call": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        },
        {"role": "function", "name": "add", "content": "5"},
    ]
    prompt = render(messages)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in prompt
    assert '<tool_response name="add" id="">\n5\n</tool_response>' in prompt


def test_a_template_that_knows_tools_renders_them() -> None:
    prompt = render(HISTORY, native=True)
    assert "Tools: get_weather, add" in prompt
    assert 'get_weather {"city": "Paris", "unit": "celsius"}</tool_call>' in prompt  # an object
    assert "<|im_start|>tool\n21 degrees (call_a)" in prompt
    assert "You can call these tools" not in prompt


def test_supports_tools_is_read_from_the_template() -> None:
    assert ChatTemplate(TOOL_TEMPLATE).supports_tools
    assert not ChatTemplate(CHATML_TEMPLATE).supports_tools


def test_a_malformed_call_in_history_is_a_400() -> None:
    messages = [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]
    with pytest.raises(APIError) as info:
        render_messages(messages, None, native=False)
    assert info.value.param == "messages[0].tool_calls[0]"
