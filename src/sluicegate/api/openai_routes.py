"""``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (and one model by id) and
request cancellation."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.request_objective import RequestObjective, request_objective
from sluicegate.admission.tenants import Tenant
from sluicegate.api import prefill
from sluicegate.api.access import not_found, owner_admits, presented_resume_token
from sluicegate.api.body import parse_json, read_body
from sluicegate.api.embeddings import embedding_model_entry
from sluicegate.api.jobs import job_payload, job_view
from sluicegate.api.pipelines import submit_prepared
from sluicegate.api.prepare import Kind, Prepared, prepare, response_body, stream_format
from sluicegate.api.state import app_state, ready_state
from sluicegate.api.stats import json_response
from sluicegate.errors import APIError, invalid_param
from sluicegate.pipeline.embedding import embedding_available
from sluicegate.service.collect import collect
from sluicegate.service.service import Service

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: HTTPRequest) -> Response:
    """The served models (upstream mode: what the upstreams serve), the pipelines, and the
    embedding model when it is installed.  With tenants configured it needs a tenant's
    key (or the admin key), like every other route."""
    return json_response({"object": "list", "data": _models(request)})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: HTTPRequest) -> Response:
    """One model, as listed; a 404 in OpenAI's shape for any other id."""
    for entry in _models(request):
        if entry["id"] == model_id:
            return json_response(entry)
    raise APIError(
        404,
        f"The model '{model_id}' does not exist (see GET /v1/models).",
        param="model",
        code="model_not_found",
    )


def _models(request: HTTPRequest) -> list[dict[str, object]]:
    state = app_state(request)
    service = ready_state(request).service
    header = request.headers.get("authorization")
    if service.tenants.auth_enabled and not state.admin_key.admits(header):
        service.authenticate(header)
    created = int(state.started_at)
    models: list[dict[str, object]] = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "sluicegate",
            "max_model_len": service.model_max_len(name),
        }
        for name in service.model_names
    ]
    for pipeline in service.pipelines.by_name.values():
        models.append(
            {
                "id": pipeline.name,
                "object": "model",
                "created": created,
                "owned_by": "sluicegate",
                "max_model_len": service.max_model_len,
                "pipeline": {
                    "stages": [s.name for s in pipeline.settings.stages],
                    "retrieval": pipeline.retriever is not None,
                },
            }
        )
    if embedding_available():
        models.append(embedding_model_entry(created))
    listed = {entry["id"] for entry in models}
    for name in service.embedding_models:  # the upstreams' own (upstream mode)
        if name not in listed:
            entry = {"id": name, "object": "model", "created": created, "task": "embed"}
            models.append({**entry, "owned_by": "sluicegate"})
    return models


async def handle(request: HTTPRequest, kind: Kind) -> Response:
    arrival = time.monotonic()
    state = app_state(request)
    ready = state.require_ready()
    service = ready.service
    tenant = service.authenticate(request.headers.get("authorization"))
    # The tenant's request limit is charged before the body is read: parsing and
    # tokenising cannot be used to get round it.
    await service.charge_request(tenant)
    raw = await read_body(request, service.settings.max_request_body_bytes)
    background, prepared = await state.body_workers.run(
        len(raw), lambda: parse_and_prepare(service, kind, raw)
    )
    if background:
        if prepared.req.stream:
            raise APIError(
                400,
                "A background job cannot stream; drop 'stream' or 'background'.",
                param="background",
            )
        record = await ready.jobs.submit(
            tenant.name,
            job_payload(prepared),
            charge=lambda: service.charge_tokens(
                tenant,
                len(prepared.prompt_ids),
                prepared.sampling.max_tokens * prepared.sampling.n,
            ),
        )
        return json_response(job_view(record), status_code=202)
    req = prepared.req
    objective = stated_objective(service, request, tenant, req.priority)
    prefill.supersede(state, service, tenant.name, req.user or "")
    generation = await submit_prepared(service, tenant, prepared, arrival, objective)
    if req.stream:
        # A resumable stream: logged event by event, it survives its connection.
        session = await ready.sessions.open(
            generation,
            tenant,
            stream_format(service, prepared, generation.created, generation.priority_label),
        )
        return session.response(0, generation.headers)
    output, answer = await collect(service, generation, disconnected(request))
    return json_response(
        response_body(service, prepared, generation, output, answer), headers=generation.headers
    )


def stated_objective(
    service: Service, request: HTTPRequest, tenant: Tenant, priority: str | None
) -> RequestObjective:
    """What the request's headers state for it (its own TTFT objective, its deadline),
    checked against its tenant's range; raises the 400 that names a bad header."""
    slo = service.slo
    class_ttft = slo.objectives[tenant.class_for(priority)].ttft_seconds if slo else None
    return request_objective(request.headers, tenant, class_ttft)


def parse_and_prepare(service: Service, kind: Kind, raw: bytes) -> tuple[bool, Prepared]:
    """``(background, prepared)`` from a raw body; may run on a worker thread."""
    body = parse_json(raw)
    background = False
    if isinstance(body, dict):
        flag = body.pop("background", False)
        if not isinstance(flag, bool):
            raise invalid_param("background", f"background must be true or false; got {flag!r}")
        background = flag
    return background, prepare(service, kind, body)


@router.post("/v1/chat/completions")
async def chat_completions(request: HTTPRequest) -> Response:
    return await handle(request, "chat")


@router.post("/v1/completions")
async def completions(request: HTTPRequest) -> Response:
    return await handle(request, "completion")


@router.post("/v1/requests/{request_id}/cancel")
async def cancel_request(request_id: str, request: HTTPRequest) -> Response:
    """Cancel a running or queued request by id (the ``id`` of its chunks).

    Only its owner can cancel it: the tenant that made it or, in open mode, the holder of
    its resume token.  Anyone else gets the same 404 as for an unknown id.
    """
    ready = ready_state(request)
    service = ready.service
    tenant = service.authenticate(request.headers.get("authorization"))
    generation = service.generations.get(request_id)
    token = presented_resume_token(request)
    if generation is None or not owner_admits(ready, generation.owner, tenant.name, token):
        open_mode = not service.tenants.auth_enabled
        raise not_found("running request", "request_id", request_id, open_mode=open_mode)
    service.cancel(generation)
    return json_response({"id": request_id, "object": "request.cancelled", "cancelled": True})


async def disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
