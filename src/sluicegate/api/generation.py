"""From a validated OpenAI request to a running sequence, and back to text."""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass, field

from sluicegate.api.errors import APIError, invalid_param
from sluicegate.api.runtime import Runtime
from sluicegate.api.schemas import _Common, stop_sequences
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from sluicegate.stream.output import RequestOutput, RequestStream


@dataclass(slots=True)
class Generation:
    """One accepted request: its id, sequence and output stream."""

    request_id: str
    request: Request
    stream: RequestStream
    created: int = field(default_factory=lambda: int(time.time()))
    finished: bool = False


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(runtime: Runtime, requested: int | None, num_prompt_tokens: int) -> int:
    """Check the context limits; say which one is exceeded and by how much."""
    limit = runtime.max_model_len
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
        return min(runtime.settings.default_max_tokens, room)
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


def build_sampling(req: _Common, max_tokens: int) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        seed=req.seed if req.seed is not None else secrets.randbits(63),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        stop=stop_sequences(req.stop),
        ignore_eos=req.ignore_eos,
    )


def start_generation(
    runtime: Runtime, request_id: str, prompt_ids: list[int], sampling: SamplingParams
) -> Generation:
    if runtime.core is None or not runtime.ready:
        raise APIError(
            503,
            "The model is still loading; retry shortly.",
            code="not_ready",
            headers={"retry-after": "2"},
        )
    request = Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling)
    stream = RequestStream(request_id)
    runtime.core.add_request(request, stream)
    return Generation(request_id, request, stream)


def abort_generation(runtime: Runtime, generation: Generation) -> None:
    if not generation.finished and runtime.core is not None:
        generation.finished = True
        runtime.core.abort_request(generation.request_id)


def engine_failure(output: RequestOutput) -> APIError:
    return APIError(
        500,
        f"The engine failed while generating: {output.error or 'unknown error'}. "
        "The request was not completed; it is safe to retry.",
        code="engine_error",
    )


def finish_reason_text(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return "stop" if reason == FinishReason.ABORT else "error"
