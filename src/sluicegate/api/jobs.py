"""``GET /v1/jobs/{id}``, and how a journaled background request is run and shown.

``"background": true`` on a completion request journals it (see
:mod:`sluicegate.queue.jobs`); its result is the body a non-streamed request would have
got.  The journal keeps only the validated fields that running it needs (:data:`JOB_FIELDS`):
unknown fields, and known ones without effect on the answer (``user``, ``stream_options``,
...), are not stored.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.api.prepare import Kind, Prepared, prepare, response_body
from sluicegate.api.state import ready_state
from sluicegate.errors import APIError
from sluicegate.queue.jobs import JobExecutor
from sluicegate.queue.journal import JobRecord, JobState
from sluicegate.service.collect import collect
from sluicegate.service.service import Service

router = APIRouter()


#: The fields of a request that its job's answer depends on: all the journal keeps.
_COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "ignore_eos",
    "max_tokens_per_second",
    "n",
}
JOB_FIELDS: dict[Kind, dict[str, Any]] = {
    "chat": {
        **dict.fromkeys(_COMMON_FIELDS, True),
        "max_completion_tokens": True,
        "messages": {"__all__": {"role": True, "content": True}},
    },
    "completion": {**dict.fromkeys(_COMMON_FIELDS, True), "prompt": True},
}


def job_payload(prepared: Prepared) -> str:
    """What the journal keeps of a validated background request (:data:`JOB_FIELDS`)."""
    body = prepared.req.model_dump(include=JOB_FIELDS[prepared.kind], exclude_none=True)
    return orjson.dumps({"kind": prepared.kind, "body": body}).decode()


def job_executor(service: Service) -> JobExecutor:
    """Runs a journaled request through the service as batch-class work."""

    async def execute(record: JobRecord) -> str:
        tenant = service.tenants.get(record.tenant)
        if tenant is None:
            raise APIError(400, f"tenant {record.tenant!r} no longer exists")
        payload = orjson.loads(record.body_json)
        prepared = prepare(service, payload["kind"], dict(payload["body"]))
        # Its rate limits were charged when it was submitted.
        generation = await service.submit(
            tenant,
            "batch",
            prepared.request_id,
            prepared.prompt_ids,
            prepared.sampling,
            prepared.req.max_tokens_per_second,
            rate_limits_charged=True,
            upstream_call=prepared.upstream_call,
        )
        output, answer = await collect(service, generation, None)
        return orjson.dumps(response_body(service, prepared, generation, output, answer)).decode()

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
