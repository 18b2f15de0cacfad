"""A Responses API request as the chat completion it is generated as.

``input`` (a string, or items: messages with text parts, earlier function calls and
their outputs), ``instructions``, function ``tools``, ``tool_choice``, ``text.format``
and the sampling fields become a chat completion body, which the chat path validates,
tokenises and runs (embedded, or relayed to an upstream's chat completions).  What the
chat path cannot serve is refused here with a 400 that names the Responses parameter:
built-in tools, images and files, reasoning.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel

from sluicegate.api.schemas import REQUEST_MODEL_CONFIG, parse_body
from sluicegate.errors import APIError, invalid_param

#: OpenAI's bounds on ``metadata``.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class TextFormat(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    model: str | None = None
    #: A string or a list of items (checked by :func:`parse_request`: a union's error
    #: would name its branch, not the parameter).
    input: Any = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextFormat | None = None
    stream: bool | None = False
    background: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    reasoning: Any = None
    #: Sluicegate (and vLLM) extensions, as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    priority: Literal["interactive", "batch"] | None = None
    max_tokens_per_second: float | None = None
    stream_options: dict[str, Any] | None = None


def parse_request(body: Any) -> ResponsesRequest:
    req: ResponsesRequest = parse_body(ResponsesRequest, body)  # type: ignore[arg-type]
    if req.input is None:
        raise APIError(
            400,
            "Missing required parameter: 'input'.",
            param="input",
            code="missing_required_parameter",
        )
    if not isinstance(req.input, str | list):
        raise invalid_param(
            "input", f"input is a string or a list of items; got {req.input!r:.100}"
        )
    if req.background and req.store is False:
        raise invalid_param("background", "a background response is stored: drop 'store: false'")
    if req.reasoning not in (None, {}) and (req.reasoning or {}).get("effort") is not None:
        raise APIError(
            400,
            "'reasoning' is not supported by this server: its models do not reason.",
            param="reasoning",
            code="unsupported_parameter",
        )
    check_metadata(req.metadata)
    return req


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid_param("metadata", f"at most {MAX_METADATA_KEYS} keys; got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid_param(
                "metadata",
                f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"{MAX_METADATA_VALUE_CHARS}; '{key[:80]}' is over",
            )


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message), each checked."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    items: list[dict[str, Any]] = []
    for position, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise invalid_param(
                "input", f"input[{position}] must be an object (a message or a function call)"
            )
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            items.append({"type": "message", **item, "content": _text(item, position)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise invalid_param("input", f"input[{position}].{key} must be a string")
            items.append(dict(item))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
                raise invalid_param(
                    "input",
                    f"input[{position}] (function_call_output) needs 'call_id' and 'output'",
                )
            if isinstance(output, list):
                output = "".join(str(p.get("text") or "") for p in output if isinstance(p, dict))
            items.append({**item, "output": output})
        elif kind in ("reasoning", "item_reference"):
            continue  # nothing to render: this server's models do not reason
        else:
            raise APIError(
                400,
                f"input[{position}] has type '{kind}', which this server does not support "
                "(messages, function_call and function_call_output are).",
                param="input",
                code="unsupported_parameter",
            )
        if items and items[-1].get("type") == "message":
            role = items[-1].get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid_param("input", f"input[{position}].role is not a role: {role!r}")
    return items


def _text(item: dict[str, Any], position: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_param("input", f"input[{position}].content must be a string or parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        else:
            raise APIError(
                400,
                f"input[{position}].content has a '{kind}' part; this server reads text only.",
                param="input",
                code="unsupported_parameter",
            )
    return "".join(texts)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as chat messages: consecutive function calls become one assistant turn."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
    return messages


def output_items_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output, as the input items a continuation starts from."""
    items: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text") or "" for p in item.get("content") or ())
            items.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def chat_tools(req: ResponsesRequest) -> tuple[list[Any] | None, Any]:
    """``tools`` and ``tool_choice`` in the chat shape."""
    tools = None
    if req.tools is not None:
        tools = []
        for position, tool in enumerate(req.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise APIError(
                    400,
                    f"tools[{position}] has type '{kind}': this server runs function tools "
                    "only (no built-in tools).",
                    param="tools",
                    code="unsupported_parameter",
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            if tool.get("strict") is not None:
                function["strict"] = tool["strict"]
            tools.append({"type": "function", "function": function})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid_param(
                "tool_choice", "tool_choice is 'none', 'auto', 'required' or a function by name"
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = None if req.text is None else req.text.format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_param(
        "text.format",
        f"text.format.type is text, json_object or json_schema; got {fmt.get('type')!r}",
    )


def chat_body(
    req: ResponsesRequest, messages: list[dict[str, Any]], raw: dict[str, Any]
) -> dict[str, Any]:
    """The chat completion body a response is generated as (``raw``: the request as sent,
    whose unknown fields an upstream may still read)."""
    tools, choice = chat_tools(req)
    body: dict[str, Any] = {
        key: value for key, value in raw.items() if key not in _RESPONSES_ONLY and value is not None
    }
    system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    body["messages"] = system + messages
    body["stream"] = False
    optional = {
        "max_completion_tokens": req.max_output_tokens,
        "tools": tools,
        "tool_choice": choice,
        "response_format": response_format(req),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


#: Fields of a Responses request with no chat counterpart (or a translated one).
_RESPONSES_ONLY = frozenset(
    {
        "input",
        "instructions",
        "max_output_tokens",
        "tools",
        "tool_choice",
        "text",
        "stream",
        "background",
        "store",
        "metadata",
        "previous_response_id",
        "truncation",
        "reasoning",
        "include",
        "stream_options",
        "conversation",
        "prompt",
        "service_tier",
        "top_logprobs",
    }
)

#: Chat parameter names in errors, as the Responses API names them.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def as_responses_error(error: APIError) -> APIError:
    """A chat path's error, naming the Responses parameter."""
    param = error.param
    if param is not None:
        head, _, rest = param.partition(".")
        if head in _PARAMS:
            error.param = _PARAMS[head] + ("." + rest if rest else "")
            error.message = error.message.replace(head, _PARAMS[head])
    return error


def template(
    response_id: str,
    model: str,
    req: ResponsesRequest,
    tools: list[Any] | None,
) -> dict[str, Any]:
    """The response object's fixed fields."""
    fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store is not False,
        "background": bool(req.background),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": tools or [],
        "truncation": req.truncation or "disabled",
        "user": req.user,
    }
