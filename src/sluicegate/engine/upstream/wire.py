"""What goes to an upstream and what comes back: request bodies (first calls and
continuations) and the server-sent events of its streamed answer.

Every call is streamed, whatever the client asked for: only a streamed answer can be
paused (by not reading it), cancelled at once (by closing it) and continued elsewhere
after a failure.  The client's body is passed through, less Sluicegate's own fields, with
the model name mapped and ``max_tokens`` resolved: whatever else it holds (tools, ``n``,
log probabilities, an engine's own fields) is the upstream's to serve or refuse.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from sluicegate.upstream_settings import ContinueStyle

Kind = Literal["chat", "completion"]

#: Body fields that are Sluicegate's own (or that it sets itself): never forwarded.
_OWN_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "max_tokens_per_second",
        "priority",
    }
)


@dataclass(slots=True)
class UpstreamCall:
    """A request as the upstream is sent it."""

    kind: Kind
    #: The client's body, less Sluicegate's fields (see :func:`forwarded_body`).
    body: dict[str, Any]
    #: The served model name the client asked for (mapped per upstream).
    model: str
    max_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "body": self.body,
            "model": self.model,
            "max_tokens": self.max_tokens,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UpstreamCall:
        kind: Kind = "chat" if data.get("kind") == "chat" else "completion"
        return cls(kind, dict(data["body"]), str(data["model"]), int(data["max_tokens"]))


def forwarded_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the upstream gets it: Sluicegate's own fields left out."""
    return {k: v for k, v in body.items() if k not in _OWN_FIELDS}


#: What a completion-style continuation of a chat request keeps of its body: the
#: sampling fields both endpoints take.  (Tools and response formats are chat-only.)
_SAMPLING_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "user",
        "ignore_eos",
    }
)


def request_body(
    call: UpstreamCall,
    upstream_model: str,
    partial_text: str,
    tokens_left: int,
    style: ContinueStyle = "auto",
    render: Callable[[list[dict[str, Any]]], str | None] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The path and body of one call.  ``partial_text``: what the client already has (a
    continuation after a pause or a failure), ``tokens_left``: its ``max_tokens``.

    A chat continuation either appends the partial answer as an assistant message and
    asks the upstream to continue it (style ``chat``: vLLM and SGLang take
    ``continue_final_message``, llama.cpp a final assistant message as a prefill), or
    (style ``completion``, with ``render`` the gateway's chat template, None when it
    cannot render these messages) continues the rendered conversation plus the partial
    answer on ``/v1/completions``; without a rendering, the partial answer is sent as a
    final assistant message for the upstream to take as a prefill, or as a new turn.  A completion
    continues from prompt + text.
    """
    stream_fields = {
        "model": upstream_model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max(1, tokens_left),
    }
    body = dict(call.body) | stream_fields
    if call.kind == "chat" and partial_text and style == "completion" and render is not None:
        rendered = render(list(call.body["messages"]))
        if rendered is not None:
            kept = {k: v for k, v in call.body.items() if k in _SAMPLING_FIELDS}
            if call.body.get("logprobs") is True:  # chat's switch, as completions ask it
                kept["logprobs"] = call.body.get("top_logprobs") or 0
            return "/v1/completions", kept | stream_fields | {"prompt": rendered + partial_text}
    path = "/v1/chat/completions" if call.kind == "chat" else "/v1/completions"
    if not partial_text:
        return path, body
    if call.kind == "chat":
        body["messages"] = [*body["messages"], {"role": "assistant", "content": partial_text}]
        if style != "completion":  # no template to render with: a new turn, as a prefill
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            body["prompt"] = prompt + partial_text
        # A prompt of token ids cannot be extended by text: the continuation restarts it
        # (the client still sees no text twice; see docs/upstream.md).
    return path, body


@dataclass(slots=True)
class ChoiceDelta:
    """One choice's part of an upstream event, in the shapes :class:`RequestOutput`
    carries (chat-shaped log probabilities, OpenAI's streamed tool-call fragments)."""

    index: int = 0
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    refusal: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    #: The choice's own finish reason, as the upstream names it.
    finish_reason: str | None = None
    #: Its delta holds something besides its role (content, or parts the gateway does
    #: not relay, such as a reasoning model's ``reasoning_content``): the upstream is
    #: working on it, which an empty delta or an SSE comment does not show.
    progress: bool = False

    @property
    def has_content(self) -> bool:
        return bool(self.text or self.tool_calls or self.refusal or self.logprobs)

    @property
    def text_size(self) -> int:
        """Characters of text it carries: content, refusal, call names and arguments."""
        calls = sum(
            len(str(f.get("name") or "")) + len(str(f.get("arguments") or ""))
            for call in self.tool_calls
            if isinstance(f := call.get("function") or {}, dict)
        )
        return len(self.text) + len(self.refusal) + calls


@dataclass(slots=True)
class Delta:
    """One event of an upstream's stream."""

    choices: list[ChoiceDelta] = field(default_factory=list)
    #: ``usage`` when the event carries it (the last one, with ``include_usage``).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Prompt tokens its engine reused from its prefix cache (``cached_tokens``).
    cached_tokens: int = 0
    done: bool = False
    error: dict[str, Any] | None = field(default=None)


def parse_event(data: bytes) -> Delta | None:
    """The payload of one ``data:`` line (None for one that says nothing).  Every choice
    is kept, with its text, tool-call fragments, refusal, log probabilities and finish."""
    data = data.strip()
    if data == b"[DONE]":
        return Delta(done=True)
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    if isinstance(event.get("error"), dict):
        return Delta(error=event["error"])
    delta = Delta()
    usage = event.get("usage")
    if isinstance(usage, dict):
        delta.prompt_tokens = _count(usage.get("prompt_tokens"))
        delta.completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            delta.cached_tokens = _count(details.get("cached_tokens")) or 0
    choices = event.get("choices")
    if isinstance(choices, list):
        delta.choices = [_choice(c) for c in choices if isinstance(c, dict)]
    return delta


def _choice(choice: dict[str, Any]) -> ChoiceDelta:
    out = ChoiceDelta(index=_count(choice.get("index")) or 0)
    inner = choice.get("delta")
    if isinstance(inner, dict):  # a chat chunk
        out.progress = any(value for key, value in inner.items() if key != "role")
        out.text = _text(inner.get("content"))
        out.refusal = _text(inner.get("refusal"))
        calls = inner.get("tool_calls")
        if isinstance(calls, list):
            out.tool_calls = [c for c in calls if isinstance(c, dict)]
        elif isinstance(inner.get("function_call"), dict):
            # The deprecated single-call shape: one call, at index 0.
            out.tool_calls = [{"index": 0, "type": "function", "function": inner["function_call"]}]
    else:  # a completion chunk
        out.text = _text(choice.get("text"))
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if isinstance(content, list):
            out.logprobs = [e for e in content if isinstance(e, dict)]
        elif isinstance(logprobs.get("tokens"), list):
            out.logprobs = chat_logprobs(logprobs)
    reason = choice.get("finish_reason")
    out.finish_reason = reason if isinstance(reason, str) else None
    out.progress = out.progress or out.has_content or out.finish_reason is not None
    return out


def chat_logprobs(legacy: dict[str, Any]) -> list[dict[str, Any]]:
    """Completions' legacy log probabilities (``tokens``, ``token_logprobs``,
    ``top_logprobs``) as the chat-shaped entries an output carries (the writer turns them
    back into the legacy shape for a completions client)."""
    tokens = legacy.get("tokens") or []
    values = legacy.get("token_logprobs") or []
    tops = legacy.get("top_logprobs") or []
    entries: list[dict[str, Any]] = []
    for i, token in enumerate(tokens):
        token = str(token)
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        entries.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) else None,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": str(t), "logprob": v, "bytes": list(str(t).encode())}
                    for t, v in top.items()
                ],
            }
        )
    return entries


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_message(status: int, content: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an upstream's error answer, whatever its shape."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        text = content.decode(errors="replace").strip()[:300]
        return (text or f"the upstream answered {status}", None, None)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = error.get("message")
        param, code = error.get("param"), error.get("code")
        return (
            str(message) if message else f"the upstream answered {status}",
            param if isinstance(param, str) else None,
            code if isinstance(code, str) else None,
        )
    if isinstance(error, str):  # TGI, some llama.cpp builds
        return error, None, None
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"], None, None
    return f"the upstream answered {status}", None, None


class EventTooLarge(ValueError):
    """An upstream sent a line longer than the gateway takes."""


async def bounded_lines(chunks: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[str]:
    """The lines of a byte stream (``\\n`` or ``\\r\\n`` ends one), none longer than
    ``max_bytes``: a longer one raises :class:`EventTooLarge` once that many bytes are
    held, so a hostile upstream's one huge event costs ``max_bytes`` of memory, not its
    size (``httpx``'s own line reader holds a whole line)."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end])
            if len(line) > max_bytes:
                raise EventTooLarge(f"a line of {len(line)} bytes (at most {max_bytes})")
            yield line.removesuffix(b"\r").decode("utf-8", errors="replace")
            start = end + 1
        del buffer[:start]
        if len(buffer) > max_bytes:
            raise EventTooLarge(f"a line of over {max_bytes} bytes")
    if buffer:
        yield bytes(buffer).removesuffix(b"\r").decode("utf-8", errors="replace")
