"""The sim engine's answer to a request with tools: it follows no grammar, so it is
given one, a pure function of the seed, valid for the tools' schemas.

- a named function: one call of it;
- ``required``: one call, or two (of different tools, when there are two and
  ``parallel_tool_calls`` allows), starting at a tool chosen by the seed;
- ``auto``: a call when the last message is the user's; after a tool result, one short
  sentence and the end of the answer (:data:`AFTER_TOOL_RESULT`), so that an agent loop
  against the sim ends, and ends complete (an agent SDK refuses an answer cut at its
  length limit, which the sim's own words, never ending, always are);
- ``none``: text.
"""

from __future__ import annotations

from sluicegate.tools.example import example_instance
from sluicegate.tools.spec import ToolChoice, ToolPlan
from sluicegate.tools.syntax import CALL_SEPARATOR, call_text, dump_json

#: The sim's answer to a tool result under ``auto``.
AFTER_TOOL_RESULT = "The tool has answered."


def sim_answer(plan: ToolPlan, last_role: str | None, seed: int) -> str | None:
    """The scripted answer (None: the sim's ordinary text); ``last_role``: the role of the
    request's last message, as the client sent it."""
    functions = plan.callable
    if not functions:
        return None
    if plan.choice == ToolChoice.AUTO and last_role == "tool":
        return AFTER_TOOL_RESULT
    if plan.choice == ToolChoice.AUTO and last_role != "user":
        return None
    count = 2 if plan.choice == ToolChoice.REQUIRED and plan.parallel else 1
    start = seed % len(functions)
    chosen = [functions[(start + i) % len(functions)] for i in range(min(count, len(functions)))]
    return CALL_SEPARATOR.join(
        call_text(f.name, dump_json(example_instance(f.parameters, seed + i)))
        for i, f in enumerate(chosen)
    )
