"""From an OpenAI request body to what the service runs, and from its output back to
OpenAI's shapes: validation, the chat template, tokenisation, context limits, sampling."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

from sluicegate.api.schemas import (
    ChatCompletionRequest,
    CommonParams,
    CompletionRequest,
    chat_messages,
    check_chat,
    check_completion,
    completion_prompt,
    parse_body,
    stop_sequences,
)
from sluicegate.api.tool_calls import prepare_tools
from sluicegate.engine.grammar import GrammarError, grammar_for_response_format
from sluicegate.engine.output import Answer, RequestOutput
from sluicegate.engine.tokenizer import ChatTemplateError
from sluicegate.engine.upstream.wire import UpstreamCall, forwarded_body
from sluicegate.errors import APIError, invalid_param
from sluicegate.pipeline.pipelines import Pipeline
from sluicegate.pipeline.retrieve import Retrieved
from sluicegate.scheduler.request import SamplingParams
from sluicegate.service.generation import Generation, finish_reason_text, new_request_id
from sluicegate.service.service import Service
from sluicegate.stream.events import StreamFormat, completion_logprobs, usage

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class Prepared:
    """A validated, tokenised request, not yet admitted."""

    kind: Kind
    req: ChatCompletionRequest | CompletionRequest
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    #: The model it names (or the default one).
    model: str
    #: Upstream mode: what the upstream is sent.
    upstream_call: UpstreamCall | None = None
    #: The pipeline it names (``model`` is then the pipeline's name).
    pipeline: Pipeline | None = None
    #: What the pipeline retrieved for it.
    retrieved: Retrieved | None = None
    #: The text its pipeline's input guard checks (the last user message).
    guarded_text: str = ""


def prepare(service: Service, kind: Kind, body: Any) -> Prepared:
    """Validate and tokenise; every problem is a 400 that names the parameter."""
    tokenizer = service.tokenizer
    relays = service.core.features.relays
    if kind == "chat":
        chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
        check_chat(chat, relays)
        model = check_model(service, chat.model)
        pipeline = service.pipelines.get(model)
        if pipeline is not None and chat.n is not None and chat.n > 1:
            raise invalid_param(
                "n", f"'{model}' is a pipeline: its stages read one answer (n=1); got n={chat.n}"
            )
        engine_model = model if pipeline is None else pipeline.settings.model or service.model_name
        check_top_k(service, chat)
        messages = chat_messages(chat)
        guarded = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        retrieved = None
        if pipeline is not None:
            messages, retrieved = pipeline.messages(messages)
            if service.core.features.relays:
                body = {**body, "messages": messages}
        tools = prepare_tools(service, chat, messages)
        try:
            prompt_ids = tokenizer.encode_chat(tools.messages, tools.template_tools)
        except ChatTemplateError as exc:
            if not relays:
                raise APIError(
                    400, f"The messages cannot be formatted: {exc}", param="messages"
                ) from None
            # The upstream renders them with its own template: counted as plain text.
            prompt_ids = tokenizer.encode("\n".join(m["content"] for m in messages))
        requested = chat.max_completion_tokens
        if requested is None:
            requested = chat.max_tokens
        max_tokens = resolve_max_tokens(service, requested, len(prompt_ids), engine_model)
        check_pace(service, chat.max_tokens_per_second)
        grammar = tools.grammar if tools.decides_grammar else response_grammar(service, chat)
        sampling = build_sampling(service, chat, max_tokens, grammar)
        sampling = tools.sampling(sampling, sim=not service.core.features.constrains_output)
        return Prepared(
            kind,
            chat,
            new_request_id("chatcmpl"),
            prompt_ids,
            sampling,
            model,
            upstream_call(service, kind, body, engine_model, sampling),
            pipeline,
            retrieved,
            guarded,
        )
    comp: CompletionRequest = parse_body(CompletionRequest, body)
    check_completion(comp, relays)
    model = check_model(service, comp.model)
    if service.pipelines.get(model) is not None:
        raise APIError(
            400,
            f"'{model}' is a pipeline: it serves chat completions (/v1/chat/completions).",
            param="model",
            code="model_not_supported",
        )
    check_top_k(service, comp)
    prompt = completion_prompt(comp, relays)
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)
    else:
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"prompt token ids must be in [0, {tokenizer.vocab_size}); got {bad}",
                param="prompt",
            )
        prompt_ids = prompt
    if not prompt_ids:
        raise APIError(400, "The prompt is empty; send at least one token.", param="prompt")
    max_tokens = resolve_max_tokens(service, comp.max_tokens, len(prompt_ids), model)
    check_pace(service, comp.max_tokens_per_second)
    sampling = build_sampling(service, comp, max_tokens)
    return Prepared(
        kind,
        comp,
        new_request_id("cmpl"),
        prompt_ids,
        sampling,
        model,
        upstream_call(service, kind, body, model, sampling),
    )


def check_model(service: Service, model: str | None) -> str:
    """The model asked for is one served, or a pipeline (a request that names none gets
    the first model)."""
    names = [*service.model_names, *service.pipelines.names]
    if model is None:
        model = service.model_name
    if model not in names:
        served = ", ".join(f"'{n}'" for n in names) or "no model (no upstream is reachable)"
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves {served} "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    return model


def upstream_call(
    service: Service, kind: Kind, body: dict[str, Any], model: str, sampling: SamplingParams
) -> UpstreamCall | None:
    """Upstream mode: the client's body as the upstream gets it (the seed always set, so
    that an engine that honours seeds continues a moved answer as it began)."""
    if not service.core.features.relays:
        return None
    forwarded = forwarded_body(body)
    forwarded["seed"] = sampling.seed
    return UpstreamCall(kind, forwarded, model, sampling.max_tokens)


def check_pace(service: Service, max_tokens_per_second: float | None) -> None:
    """A pace below the floor would hold a sequence's KV cache (and the client's stream)
    for hours: refuse it, saying the floor."""
    floor = service.settings.pace_floor_tokens_per_second
    if max_tokens_per_second is not None and not max_tokens_per_second >= floor:
        raise invalid_param(
            "max_tokens_per_second",
            f"max_tokens_per_second must be at least {floor:g} (this server's "
            f"pace_floor_tokens_per_second); got {max_tokens_per_second:g}",
        )


def check_top_k(service: Service, req: CommonParams) -> None:
    """``top_k`` above the vocabulary would mean "no limit" in a roundabout way: say so."""
    vocab_size = service.tokenizer.vocab_size
    if req.top_k is not None and req.top_k > vocab_size:
        raise invalid_param(
            "top_k",
            f"top_k must be at most the vocabulary size ({vocab_size}), or -1 or 0 for no "
            f"limit; got {req.top_k}",
        )


def resolve_max_tokens(
    service: Service, requested: int | None, num_prompt_tokens: int, model: str
) -> int:
    """Check the context limits (``model``'s: an upstream's own); say which one is
    exceeded and by how much."""
    limit = service.model_max_len(model)
    if num_prompt_tokens >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens ({num_prompt_tokens - limit + 1} too many to leave "
            "room for one generated token). Shorten the prompt.",
            param="messages",
            code="context_length_exceeded",
        )
    room = limit - num_prompt_tokens
    if requested is None:
        return min(service.settings.default_max_tokens, room)
    if requested < 1:
        raise invalid_param("max_tokens", f"max_tokens must be at least 1; got {requested}")
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and max_tokens is {requested}, "
            f"{num_prompt_tokens + requested - limit} over the limit. "
            f"Use max_tokens <= {room} or a shorter prompt.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def response_grammar(service: Service, chat: ChatCompletionRequest) -> str | None:
    """The grammar that enforces ``response_format`` on the embedded engine (None: free
    text, or an upstream engine, which is sent ``response_format`` and enforces it)."""
    fmt = chat.response_format
    features = service.core.features
    if fmt is None or fmt.get("type", "text") == "text" or features.relays:
        return None
    if not features.constrains_output:
        raise APIError(
            400,
            "Structured output (response_format) needs a model: the sim engine makes "
            "no logits to mask. Use the embedded engine or an upstream.",
            param="response_format",
            code="unsupported_parameter",
        )
    if chat.ignore_eos:
        raise invalid_param(
            "ignore_eos",
            "ignore_eos cannot be combined with response_format: the answer "
            "ends when its JSON is complete",
        )
    try:
        return grammar_for_response_format(fmt)
    except GrammarError as exc:
        raise APIError(400, str(exc), param="response_format", code="invalid_value") from None


def build_sampling(
    service: Service, req: CommonParams, max_tokens: int, grammar: str | None = None
) -> SamplingParams:
    """The request's sampling; what it does not set is the model's recommended sampling
    (:attr:`Service.sampling_defaults`)."""
    defaults = service.sampling_defaults
    top_k = defaults.top_k if req.top_k is None else max(0, req.top_k)
    return SamplingParams(
        max_tokens=max_tokens,
        seed=req.seed if req.seed is not None else secrets.randbits(63),
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        top_k=top_k,
        stop=stop_sequences(req.stop),
        ignore_eos=req.ignore_eos,
        grammar=grammar,
        logprobs=requested_logprobs(req),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=logit_bias(service, req.logit_bias),
        n=req.n or 1,
    )


def requested_logprobs(req: CommonParams) -> int | None:
    """None (no log probabilities), or how many alternatives per token."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


def logit_bias(service: Service, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs by id; an id outside the vocabulary is a
    400 (upstreams check their own)."""
    if not bias:
        return ()
    vocab_size = service.tokenizer.vocab_size
    pairs = sorted((int(key), float(value)) for key, value in bias.items())
    if not service.core.features.relays:
        bad = next((t for t, _ in pairs if t >= vocab_size), None)
        if bad is not None:
            raise invalid_param("logit_bias", f"token ids must be in [0, {vocab_size}); got {bad}")
    return tuple(pairs)


def response_body(
    service: Service,
    prepared: Prepared,
    generation: Generation,
    output: RequestOutput,
    answer: Answer,
) -> dict[str, Any]:
    """The whole (non-streamed) answer in OpenAI's shape."""
    stream_finish = finish_reason_text(output.finish_reason)
    choices: list[dict[str, Any]] = []
    for choice in answer.choices():
        finish = choice.finish or stream_finish
        text = "".join(choice.text)
        if prepared.kind == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if text or not choice.tool_calls else None,
                "refusal": "".join(choice.refusal) or None,
            }
            if choice.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": call.get("id", ""),
                        "type": call.get("type", "function"),
                        "function": {"name": "", "arguments": "", **call["function"]},
                    }
                    for call in choice.tool_calls
                ]
            logprobs = {"content": choice.logprobs, "refusal": None} if choice.logprobs else None
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
        else:
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": completion_logprobs(choice.logprobs) if choice.logprobs else None,
                    "finish_reason": finish,
                }
            )
    return {
        "id": prepared.request_id,
        "object": "chat.completion" if prepared.kind == "chat" else "text_completion",
        "created": generation.created,
        "model": prepared.model,
        "choices": choices,
        "usage": usage(output),
    }


def stream_format(
    service: Service, prepared: Prepared, created: int, priority: str
) -> StreamFormat:
    """How this request's stream is framed (and how a takeover continues it)."""
    req = prepared.req
    options = req.stream_options
    return StreamFormat(
        kind=prepared.kind,
        created=created,
        model=prepared.model,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        flush_interval_seconds=(
            None
            if options is None or options.flush_interval_ms is None
            else options.flush_interval_ms / 1000.0
        ),
        flush_max_tokens=None if options is None else options.flush_max_tokens,
        priority=priority,
        max_tokens_per_second=req.max_tokens_per_second,
        upstream_call=None if prepared.upstream_call is None else prepared.upstream_call.to_json(),
        sources=None
        if prepared.pipeline is None
        else (prepared.retrieved.sources if prepared.retrieved is not None else []),
    )
