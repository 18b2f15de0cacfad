"""``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.tenants import Tenant
from sluicegate.api.generation import (
    Generation,
    abort_generation,
    build_sampling,
    engine_failure,
    finish_reason_text,
    new_request_id,
    record_finish,
    resolve_max_tokens,
    start_generation,
    usage,
)
from sluicegate.api.runtime import Runtime, get_runtime
from sluicegate.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_chat,
    check_completion,
    completion_prompt,
    parse_body,
)
from sluicegate.api.stream_events import StreamFormat
from sluicegate.engine.output import RequestOutput
from sluicegate.engine.tokenizer import ChatTemplateError
from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason, SamplingParams

router = APIRouter()


def json_response(
    payload: object, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(payload), status_code=status_code, media_type="application/json",
        headers=headers,
    )  # fmt: skip


async def read_json(request: HTTPRequest, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"Request body is {declared} bytes; the limit is {max_bytes} bytes.")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise APIError(413, f"Request body exceeds the limit of {max_bytes} bytes.")
    if not body:
        raise APIError(400, "The request body is empty; send a JSON object.")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}.") from None


def check_model(runtime: Runtime, model: str) -> None:
    if model != runtime.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{runtime.model_name}' "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )


@router.get("/v1/models")
async def list_models(request: HTTPRequest) -> Response:
    runtime = get_runtime(request)
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": runtime.model_name,
                    "object": "model",
                    "created": int(runtime.started_at),
                    "owned_by": "sluicegate",
                    "max_model_len": runtime.max_model_len,
                }
            ],
        }
    )


@dataclass(slots=True)
class Prepared:
    """A validated, tokenised request, not yet admitted."""

    kind: Literal["chat", "completion"]
    req: ChatCompletionRequest | CompletionRequest
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


def prepare(runtime: Runtime, kind: Literal["chat", "completion"], body: Any) -> Prepared:
    """Validate and tokenise; every problem is a 400 that names the parameter."""
    tokenizer = _tokenizer(runtime)
    if kind == "chat":
        chat: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
        check_chat(chat)
        check_model(runtime, chat.model)
        try:
            prompt_ids = tokenizer.encode_chat(chat_messages(chat))
        except ChatTemplateError as exc:
            raise APIError(
                400, f"The messages cannot be formatted: {exc}", param="messages"
            ) from None
        requested = chat.max_completion_tokens
        if requested is None:
            requested = chat.max_tokens
        max_tokens = resolve_max_tokens(runtime, requested, len(prompt_ids))
        sampling = build_sampling(chat, max_tokens)
        return Prepared(kind, chat, new_request_id("chatcmpl"), prompt_ids, sampling)
    comp: CompletionRequest = parse_body(CompletionRequest, body)
    check_completion(comp)
    check_model(runtime, comp.model)
    prompt = completion_prompt(comp)
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
    max_tokens = resolve_max_tokens(runtime, comp.max_tokens, len(prompt_ids))
    sampling = build_sampling(comp, max_tokens)
    return Prepared(kind, comp, new_request_id("cmpl"), prompt_ids, sampling)


async def admit(
    runtime: Runtime, tenant: Tenant, prepared: Prepared, priority: str | None = None
) -> Generation:
    return await start_generation(
        runtime, tenant, priority or prepared.req.priority, prepared.request_id,
        prepared.prompt_ids, prepared.sampling, prepared.req.max_tokens_per_second,
    )  # fmt: skip


def response_body(
    runtime: Runtime, prepared: Prepared, generation: Generation, output: RequestOutput
) -> dict[str, Any]:
    """The whole (non-streamed) answer in OpenAI's shape."""
    finish = finish_reason_text(output.finish_reason)
    if prepared.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": output.text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": prepared.request_id,
        "object": obj,
        "created": generation.created,
        "model": runtime.model_name,
        "choices": [choice],
        "usage": usage(output),
    }


def stream_format(runtime: Runtime, prepared: Prepared, generation: Generation) -> StreamFormat:
    """How this request's stream is framed (and how a takeover continues it)."""
    req = prepared.req
    options = req.stream_options
    return StreamFormat(
        kind=prepared.kind,
        created=generation.created,
        model=runtime.model_name,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None and options.continuous_usage_stats,
        flush_interval_seconds=(
            None
            if options is None or options.flush_interval_ms is None
            else options.flush_interval_ms / 1000.0
        ),
        flush_max_tokens=None if options is None else options.flush_max_tokens,
        priority=generation.priority_label,
        max_tokens_per_second=req.max_tokens_per_second,
    )


async def handle(request: HTTPRequest, kind: Literal["chat", "completion"]) -> Response:
    runtime = get_runtime(request)
    tenant = _authenticate(runtime, request)
    body = await read_json(request, runtime.settings.max_request_body_bytes)
    background = isinstance(body, dict) and body.pop("background", False)
    prepared = prepare(runtime, kind, body)
    if background:
        if prepared.req.stream:
            raise APIError(
                400, "A background job cannot stream; drop 'stream' or 'background'.",
                param="background",
            )  # fmt: skip
        if runtime.jobs is None:
            raise APIError(503, "Background jobs are not available yet; retry shortly.")
        job = await runtime.jobs.submit(tenant, kind, body)
        return json_response(job, status_code=202)
    generation = await admit(runtime, tenant, prepared)
    if prepared.req.stream:
        # A resumable stream: logged event by event, it survives its connection.
        session = await runtime.sessions.open(
            generation, tenant, stream_format(runtime, prepared, generation)
        )
        return session.response(0, generation.headers)
    output = await collect(runtime, generation, _disconnected(request))
    return json_response(
        response_body(runtime, prepared, generation, output), headers=generation.headers
    )


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest) -> Response:
    return await handle(request, "chat")


@router.post("/v1/completions")
async def completions(request: HTTPRequest) -> Response:
    return await handle(request, "completion")


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: HTTPRequest) -> Response:
    """Cancel a running or queued request by id (the ``id`` of its chunks).

    Only the tenant that made the request can cancel it; another tenant gets the same 404
    as for an unknown id, so ids do not leak.
    """
    runtime = get_runtime(request)
    tenant = _authenticate(runtime, request)
    generation = runtime.generations.get(request_id)
    if generation is None or (
        generation.ticket is not None and generation.ticket.tenant.name != tenant.name
    ):
        raise APIError(
            404, f"No running request with id '{request_id}'.", param="request_id",
            code="not_found",
        )  # fmt: skip
    abort_generation(runtime, generation)
    return json_response({"id": request_id, "object": "request.cancelled", "cancelled": True})


async def _disconnected(request: HTTPRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _authenticate(runtime: Runtime, request: HTTPRequest) -> Tenant:
    if runtime.front_door is None:
        raise APIError(
            503, "The model is still loading; retry shortly.", code="not_ready",
            headers={"retry-after": "2"},
        )  # fmt: skip
    return runtime.front_door.authenticate(request.headers.get("authorization"))


def _tokenizer(runtime: Runtime) -> Any:
    if runtime.tokenizer is None or not runtime.ready:
        raise APIError(
            503, "The model is still loading; retry shortly.", code="not_ready",
            headers={"retry-after": "2"},
        )  # fmt: skip
    return runtime.tokenizer


async def collect(
    runtime: Runtime, generation: Generation, disconnected: Coroutine[Any, Any, None] | None
) -> RequestOutput:
    """Wait for the whole answer; abort at once if ``disconnected`` completes first."""
    watcher = asyncio.ensure_future(disconnected) if disconnected is not None else None
    text: list[str] = []
    try:
        while True:
            getter = asyncio.ensure_future(generation.stream.get())
            waiting: set[asyncio.Future[Any]] = {getter}
            if watcher is not None:
                waiting.add(watcher)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                abort_generation(runtime, generation)
                raise APIError(499, "Client closed the request.")
            output = getter.result()
            text.append(output.text)
            if output.finished:
                generation.finished = True
                if generation.drained:
                    raise APIError(
                        503, "The server is shutting down; retry the request on another replica.",
                        code="server_draining", headers={"retry-after": "1"},
                    )  # fmt: skip
                if output.finish_reason == FinishReason.ERROR:
                    record_finish(runtime, generation, "error")
                    raise engine_failure(generation, output)
                generation.record_write(runtime, output.num_output_tokens)
                record_finish(runtime, generation, finish_reason_text(output.finish_reason) or "")
                output.text = "".join(text)
                return output
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        abort_generation(runtime, generation)
