"""A chat request's tools on the embedded engines: its plan, its prompt, the grammar
its answer follows and how the answer is read (:mod:`sluicegate.tools`).

In front of upstreams none of this applies: the upstream gets ``tools`` as sent and
does its own tool calling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sluicegate.api.schemas import ChatCompletionRequest
from sluicegate.engine.grammar import GrammarError, response_schema
from sluicegate.errors import APIError, invalid_param
from sluicegate.scheduler.request import SamplingParams
from sluicegate.service.service import Service
from sluicegate.tools.grammar import tool_grammar
from sluicegate.tools.prompt import render_messages
from sluicegate.tools.schema import SchemaError
from sluicegate.tools.sim_answer import sim_answer
from sluicegate.tools.spec import ToolChoice, ToolPlan, tool_plan
from sluicegate.tools.syntax import GENERIC


@dataclass(slots=True)
class ToolRequest:
    """What a chat request's tools make of it."""

    #: Its tools (None: it offers none, or an upstream serves it).
    plan: ToolPlan | None
    #: The messages its chat template renders (tool history written out).
    messages: list[dict[str, Any]]
    #: The tools its chat template is given (None: none, or the generic format).
    template_tools: list[dict[str, Any]] | None
    #: Whether the tools decide its grammar (else ``response_format`` does).
    decides_grammar: bool = False
    #: The grammar its answer follows, when the tools decide it.
    grammar: str | None = None
    #: The role of its last message as sent (the sim answers a tool result in text).
    last_role: str | None = None

    def sampling(self, sampling: SamplingParams, sim: bool) -> SamplingParams:
        """``sampling`` with the tool format its answer is parsed with, and on the sim
        (``sim``: an engine that follows no grammar) the scripted answer."""
        plan = self.plan
        if plan is None or plan.choice == ToolChoice.NONE:
            return sampling
        answer = sim_answer(plan, self.last_role, sampling.seed) if sim else None
        return replace(sampling, tool_format=GENERIC, sim_answer=answer)


def prepare_tools(
    service: Service, chat: ChatCompletionRequest, messages: Sequence[Mapping[str, Any]]
) -> ToolRequest:
    """Check the request's tools and render its messages; every problem is a 400."""
    features = service.core.features
    if features.relays:
        return ToolRequest(None, [dict(m) for m in messages], None)
    plan = tool_plan(
        chat.tools, chat.tool_choice, chat.parallel_tool_calls, chat.functions, chat.function_call
    )
    rendered, template_tools = render_messages(
        messages, plan, service.tokenizer.chat_template.supports_tools
    )
    last_role = messages[-1]["role"] if messages else None
    request = ToolRequest(plan, rendered, template_tools, last_role=last_role)
    if plan is None or plan.choice == ToolChoice.NONE:
        return request
    if chat.ignore_eos:
        raise invalid_param(
            "ignore_eos", "ignore_eos cannot be combined with tools: an answer that calls ends"
        )
    if not features.constrains_output and not plan.forced:
        return request  # the sim: its scripted answer, and response_format as without tools
    request.decides_grammar = True
    if features.constrains_output:
        request.grammar = _grammar(plan, chat.response_format)
    return request


def _grammar(plan: ToolPlan, response_format: Mapping[str, Any] | None) -> str | None:
    """Calls only under ``required`` or a named function (``response_format`` does not
    apply to calls); under ``auto`` calls or text, the text held to ``response_format``."""
    text_schema = None
    if not plan.forced:
        try:
            text_schema = response_schema(response_format)
        except GrammarError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_value") from None
    try:
        return tool_grammar(plan, text_schema)
    except SchemaError as exc:
        raise invalid_param("tools", str(exc)) from None
