"""``GET /v1/jobs/{id}``, and how a journaled background request is run and shown.

``"background": true`` on a completion request journals it (see
:mod:`sluicegate.queue.jobs`); its result is the body a non-streamed request would have
got.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.api.prepare import prepare, response_body
from sluicegate.api.state import ready_state
from sluicegate.errors import APIError
from sluicegate.queue.jobs import JobExecutor
from sluicegate.queue.journal import JobRecord, JobState
from sluicegate.service.service import Service

router = APIRouter()


def job_payload(kind: Literal["chat", "completion"], body: dict[str, Any]) -> str:
    """What the journal keeps of a background request."""
    return orjson.dumps({"kind": kind, "body": body}).decode()


def job_executor(service: Service) -> JobExecutor:
    """Runs a journaled request through the service as batch-class work."""

    async def execute(record: JobRecord) -> str:
        tenant = service.tenants.get(record.tenant)
        if tenant is None:
            raise APIError(400, f"tenant {record.tenant!r} no longer exists")
        payload = orjson.loads(record.body_json)
        prepared = prepare(service, payload["kind"], dict(payload["body"]))
        generation = await service.submit(
            tenant, "batch", prepared.request_id, prepared.prompt_ids, prepared.sampling,
            prepared.req.max_tokens_per_second,
        )  # fmt: skip
        output = await service.collect(generation, None)
        return orjson.dumps(response_body(service, prepared, generation, output)).decode()

    return execute


def job_view(record: JobRecord) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": record.job_id,
        "object": "job",
        "status": record.state.value,
        "created_at": int(record.created_at),
        "updated_at": int(record.updated_at),
        "attempts": record.attempts,
    }
    if record.state is JobState.DONE and record.result_json is not None:
        view["result"] = orjson.loads(record.result_json)
    if record.state is JobState.FAILED:
        view["error"] = {"message": record.error, "type": "job_failed"}
    return view


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: HTTPRequest) -> Response:
    state = ready_state(request)
    tenant = state.service.authenticate(request.headers.get("authorization"))
    record = await state.jobs.get(job_id, tenant.name)
    return Response(orjson.dumps(job_view(record)), media_type="application/json")
