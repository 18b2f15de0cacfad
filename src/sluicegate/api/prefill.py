"""``POST /v1/prefill``: warm the prefix cache for a conversation while its user types.

The body is a chat request as it stands so far (the messages, the user's message still
being typed). It is admitted like any request, so it counts against the tenant's request
and token limits. It runs in the ``batch`` class, which the queue serves only when no
interactive request is waiting, and it computes its prompt and one token that nobody
reads. The answer is a 202 at once. When the final request arrives and extends the
warmed prefix, it computes only the rest (docs/prefix-cache.md). A warm-up can be
cancelled like any request (``POST /v1/requests/{id}/cancel``). A newer warm-up from the
same tenant for the same ``user`` cancels the older one, so a client that calls on every
keystroke, debounced, leaves at most one running; so does that user's real request, which
then reuses what the warm-up computed so far.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.api.body import parse_json, read_body
from sluicegate.api.prepare import prepare
from sluicegate.api.state import AppState, app_state
from sluicegate.api.stats import json_response
from sluicegate.errors import APIError, invalid_param
from sluicegate.scheduler.request import Request, Reuse
from sluicegate.service.build import prefix_namespace
from sluicegate.service.collect import collect
from sluicegate.service.generation import Generation
from sluicegate.service.ownership import RESUME_TOKEN_HEADER
from sluicegate.service.service import Service

router = APIRouter()

#: Fields of a chat body that make no sense for a warm-up (it answers nothing).
_IGNORED = (
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "background",
    "priority",
    "max_tokens_per_second",
)


@router.post("/v1/prefill", status_code=202)
async def prefill(request: HTTPRequest) -> Response:
    state = app_state(request)
    service = state.require_ready().service
    tenant = service.authenticate(request.headers.get("authorization"))
    await service.charge_request(tenant)
    body = parse_json(await read_body(request, service.settings.max_request_body_bytes))
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object (a chat completion request).")
    user = body.get("user", "")
    if not isinstance(user, str):
        raise invalid_param("user", f"user must be a string; got {type(user).__name__}")
    for name in _IGNORED:
        body.pop(name, None)
    body.update(max_tokens=1, priority="batch")
    prepared = prepare(service, "chat", body)
    peek = service.core.capacity.cached_prefix
    namespace = prefix_namespace(service.settings, tenant.name)
    probe = Request(
        prepared.request_id, prepared.prompt_ids, prepared.sampling, reuse=Reuse(namespace)
    )
    cached = peek(probe) if peek is not None else 0
    generation = await service.submit(
        tenant,
        "batch",
        prepared.request_id,
        prepared.prompt_ids,
        prepared.sampling,
        None,
        request_charged=True,
        upstream_call=prepared.upstream_call,
    )
    supersede(state, service, tenant.name, user)  # a newer warm-up cancels the older
    key = (tenant.name, user)
    state.warmups[key] = generation
    count(state, "accepted")
    task = asyncio.get_running_loop().create_task(_run(state, service, generation, key))
    state.warmup_tasks.add(task)
    task.add_done_callback(state.warmup_tasks.discard)
    headers = dict(generation.headers)
    if generation.resume_token is not None:
        headers[RESUME_TOKEN_HEADER] = generation.resume_token  # to cancel it in open mode
    return json_response(
        {
            "id": prepared.request_id,
            "object": "prefill",
            "status": "queued",
            "prompt_tokens": len(prepared.prompt_ids),
            "cached_tokens": cached,
        },
        status_code=202,
        headers=headers,
    )


def supersede(state: AppState, service: Service, tenant: str, user: str) -> None:
    """A newer warm-up or the real request of ``user`` has come: its warm-up, if one still
    runs, stops.  What it computed stays cached; the request computes the rest itself,
    with no warm-up ahead of it in the engine (and none in its predicted time to first
    token)."""
    if (running := state.warmups.pop((tenant, user), None)) is not None:
        service.cancel(running)
        count(state, "superseded")


def count(state: AppState, outcome: str) -> None:
    state.warmup_counts[outcome] = state.warmup_counts.get(outcome, 0) + 1
    state.metrics.prefill_requests_total.labels(outcome).inc()


async def _run(
    state: AppState, service: Service, generation: Generation, key: tuple[str, str]
) -> None:
    """Let the warm-up run to its end; its one token is dropped."""
    try:
        with contextlib.suppress(APIError):
            await collect(service, generation, None)
            if state.warmups.get(key) is generation:  # not superseded: it ran to its end
                count(state, "completed")
    finally:
        if state.warmups.get(key) is generation:
            del state.warmups[key]
