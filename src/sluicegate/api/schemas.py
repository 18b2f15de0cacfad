"""OpenAI request bodies, and their translation into what the scheduler needs.

Unknown fields are ignored (clients send many); known fields the embedded engine does
not support are rejected with a 400 that names them, rather than silently ignored.  In
front of upstream engines (``relays``) only what the gateway itself acts on is checked:
the rest reaches the upstream unchanged, which serves it or refuses it in its own words.
Types are strict, as in OpenAI's API: ``true`` is not an integer, ``"0.5"`` is not a
number, and no number may be NaN or infinite (every model here is ``strict``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from sluicegate.errors import APIError, invalid_param

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


#: Every request model: unknown fields ignored, strict types, finite numbers only.
REQUEST_MODEL_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    include_usage: bool = False
    continuous_usage_stats: bool = False
    #: Sluicegate extensions: per-request flush policy (0 ms = every token its own event).
    flush_interval_ms: float | None = None
    flush_max_tokens: int | None = None


class CommonParams(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    #: Optional, as in vLLM: a request that names no model gets the served one.
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    #: vLLM's extensions, served by the embedded engine too.
    repetition_penalty: float | None = None
    min_p: float | None = None
    priority: Literal["interactive", "batch"] | None = None
    #: Sluicegate extension: cap this request's generation pace.
    max_tokens_per_second: float | None = None


class ContentPart(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = REQUEST_MODEL_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's calls (OpenAI's shape; checked where they are rendered).
    tool_calls: list[Any] | None = None
    #: A tool turn: the call it answers.
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None


class CompletionRequest(CommonParams):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def parse_body(model: type[CommonParams], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = ".".join(p for p in loc if not p.isdigit()) or None
        where = "".join(
            f"[{p}]" if p.isdigit() else ("." if i else "") + p for i, p in enumerate(loc)
        )
        if err.get("type") == "missing":
            raise APIError(
                400,
                f"Missing required parameter: '{where}'.",
                param=param,
                code="missing_required_parameter",
            ) from None
        raise APIError(
            400,
            f"Invalid value for '{where}': {err.get('msg')}; got {err.get('input')!r}.",
            param=param,
            code="invalid_value",
        ) from None


def _unsupported(param: str, what: str) -> APIError:
    return APIError(
        400,
        f"'{param}' is not supported by this server: {what}.",
        param=param,
        code="unsupported_parameter",
    )


#: The most choices one request may ask for (``n``) from the embedded engine.
MAX_CHOICES = 8
#: The most alternatives per token (``top_logprobs``), as in OpenAI's API.
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


def check_common(req: CommonParams, relays: bool = False) -> None:
    """What every request must be, whoever serves it (``relays``: an upstream does)."""
    if req.n is not None and not 1 <= req.n <= (128 if relays else MAX_CHOICES):
        if req.n < 1 or relays:
            raise invalid_param("n", f"n must be at least 1; got {req.n}")
        raise invalid_param("n", f"n must be between 1 and {MAX_CHOICES}; got {req.n}")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise invalid_param(
            "temperature", f"temperature must be between 0 and 2; got {req.temperature}"
        )
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise invalid_param("top_p", f"top_p must be in (0, 1]; got {req.top_p}")
    if req.top_k is not None and req.top_k < -1:
        raise invalid_param("top_k", f"top_k must be -1 or 0 (off) or positive; got {req.top_k}")
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise invalid_param("seed", f"seed must be a 64-bit signed integer; got {req.seed}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise invalid_param(name, f"{name} must be between -2 and 2; got {value}")
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty <= 10.0:
        raise invalid_param(
            "repetition_penalty",
            f"repetition_penalty must be in (0, 10] (1: off); got {req.repetition_penalty}",
        )
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise invalid_param("min_p", f"min_p must be between 0 and 1; got {req.min_p}")
    if req.logit_bias:
        check_logit_bias(req.logit_bias)
    if req.max_tokens_per_second is not None and req.max_tokens_per_second <= 0:
        raise invalid_param(
            "max_tokens_per_second",
            f"max_tokens_per_second must be positive; got {req.max_tokens_per_second}",
        )
    options = req.stream_options
    if options is not None:
        if options.flush_interval_ms is not None and not 0 <= options.flush_interval_ms <= 1000:
            raise invalid_param(
                "stream_options.flush_interval_ms",
                f"flush_interval_ms must be between 0 and 1000; got {options.flush_interval_ms}",
            )
        if options.flush_max_tokens is not None and not 1 <= options.flush_max_tokens <= 1024:
            raise invalid_param(
                "stream_options.flush_max_tokens",
                f"flush_max_tokens must be between 1 and 1024; got {options.flush_max_tokens}",
            )
    stops = stop_sequences(req.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid_param(
            "stop", f"at most {MAX_STOP_SEQUENCES} stop sequences; got {len(stops)}"
        )
    for s in stops:
        if not s:
            raise invalid_param("stop", "stop sequences must not be empty")
        if len(s) > MAX_STOP_LENGTH:
            raise invalid_param(
                "stop",
                f"stop sequences must be at most {MAX_STOP_LENGTH} characters; got {len(s)}",
            )


def check_logit_bias(bias: dict[str, float]) -> None:
    """Token ids as keys (decimal strings), biases in [-100, 100], at most 300."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid_param(
            "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens may be biased; got {len(bias)}"
        )
    for key, value in bias.items():
        if not key.isdigit():
            raise invalid_param(
                "logit_bias", f"logit_bias keys must be token ids (digits); got {key!r}"
            )
        if not -100.0 <= value <= 100.0:
            raise invalid_param(
                "logit_bias", f"logit_bias values must be between -100 and 100; got {value}"
            )


def check_chat(req: ChatCompletionRequest, relays: bool = False) -> None:
    check_common(req, relays)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_param(
                "top_logprobs",
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}; got {req.top_logprobs}",
            )
        if req.top_logprobs and not req.logprobs:
            raise invalid_param("top_logprobs", "top_logprobs needs logprobs: true")
    if not req.messages:
        raise invalid_param("messages", "messages must hold at least one message")
    if relays:
        return  # the upstream serves (or refuses) the rest
    if req.modalities and any(m != "text" for m in req.modalities):
        raise _unsupported("modalities", "only text output")
    if req.audio is not None:
        raise _unsupported("audio", "only text output")
    for i, message in enumerate(req.messages):
        if message.content is None and message.role in ("system", "developer", "user", "tool"):
            # Only an assistant turn may go without (its tool calls say it all).
            raise invalid_param(
                f"messages[{i}].content", f"a {message.role} message needs 'content'; got null"
            )
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    raise _unsupported(
                        f"messages[{i}].content[{j}].type",
                        f"only text content parts; got {part.type!r}",
                    )
                if part.text is None:
                    raise invalid_param(
                        f"messages[{i}].content[{j}].text", "a text part needs 'text'"
                    )


def check_completion(req: CompletionRequest, relays: bool = False) -> None:
    check_common(req, relays)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_param(
            "logprobs", f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}; got {req.logprobs}"
        )
    if relays:
        return
    if req.echo:
        raise _unsupported("echo", "echoing the prompt is not implemented")
    if req.best_of is not None and req.best_of != 1:
        raise _unsupported("best_of", f"only best_of=1; got {req.best_of}")
    if req.suffix:
        raise _unsupported("suffix", "insertion is not implemented")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages flattened to ``{"role", "content"}`` strings for the chat template, with
    their tool fields (``tool_calls``, ``tool_call_id``, ``name``, ``function_call``)
    where set: history is never dropped (:mod:`sluicegate.tools.prompt` renders it)."""
    out = []
    for message in req.messages:
        if isinstance(message.content, list):
            text = "".join(part.text or "" for part in message.content)
        else:
            text = message.content or ""
        role = "system" if message.role == "developer" else message.role
        flat: dict[str, Any] = {"role": role, "content": text}
        for key in ("tool_calls", "tool_call_id", "name", "function_call"):
            if getattr(message, key) is not None:
                flat[key] = getattr(message, key)
        out.append(flat)
    return out


def stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def completion_prompt(req: CompletionRequest, relays: bool = False) -> str | list[int]:
    """One prompt, as text or token ids; several prompts are rejected (n=1 only), except
    in front of upstreams, where they are counted as one for admission."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise invalid_param("prompt", "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [int(p) for p in prompt]  # type: ignore[arg-type]
    if len(prompt) != 1 and not relays:
        raise _unsupported("prompt", f"one prompt per request; got {len(prompt)}")
    if relays and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)  # type: ignore[arg-type]
    if relays and all(isinstance(p, list) for p in prompt):
        return [int(t) for p in prompt for t in p]  # type: ignore[union-attr]
    only = prompt[0]
    if isinstance(only, str):
        return only
    return [int(p) for p in only]  # type: ignore[union-attr]
