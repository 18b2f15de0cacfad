"""OpenAI's Files and Batch APIs: ``/v1/files`` and ``/v1/batches``, so the official
client's ``files`` and ``batches`` calls work unmodified (state in
:mod:`sluicegate.queue.batches`).

A batch's lines run as background jobs in the ``batch`` class (on idle capacity, never
ahead of interactive work), each charged to its tenant's rate limits and concurrency cap
when it runs: a line refused for now waits for its ``Retry-After`` and runs then. A
line's own error (an invalid body, say) is its answer, in the error file.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.datastructures import UploadFile
from starlette.responses import FileResponse, Response

from sluicegate.api.body import parse_json, read_body
from sluicegate.api.jobs import job_executor
from sluicegate.api.prepare import Kind, prepare, response_body
from sluicegate.api.state import Ready, ready_state
from sluicegate.api.stats import json_response
from sluicegate.errors import APIError
from sluicegate.queue.batch_format import ENDPOINTS, MAX_FILE_BYTES, LineValidator
from sluicegate.queue.batches import Batches
from sluicegate.queue.jobs import JobExecutor
from sluicegate.queue.journal import JobRecord
from sluicegate.service.collect import collect
from sluicegate.service.service import Service

router = APIRouter()


def batch_aware_executor(service: Service) -> JobExecutor:
    """Runs single background jobs as before, and batch lines with their rate limits
    charged as they run; a line's non-retryable error becomes its (error) answer."""
    single = job_executor(service)

    async def execute(record: JobRecord) -> str:
        if record.batch_id is None:
            return await single(record)
        try:
            tenant = service.tenants.get(record.tenant)
            if tenant is None:
                raise APIError(400, f"tenant {record.tenant!r} no longer exists")
            payload = orjson.loads(record.body_json)
            prepared = prepare(service, payload["kind"], dict(payload["body"]))
            generation = await service.submit(
                tenant,
                "batch",
                prepared.request_id,
                prepared.prompt_ids,
                prepared.sampling,
                prepared.req.max_tokens_per_second,
                upstream_call=prepared.upstream_call,
            )
            output, answer = await collect(service, generation, None)
            body = response_body(service, prepared, generation, output, answer)
            return orjson.dumps({"status_code": 200, "body": body}).decode()
        except APIError as exc:
            if exc.status_code in (429, 503) and "retry-after" in exc.headers:
                raise  # refused for now: the runner retries it when told
            return orjson.dumps({"status_code": exc.status_code, "body": exc.body()}).decode()

    return execute


def _caller(request: HTTPRequest) -> tuple[Ready, Batches, str]:
    ready = ready_state(request)
    if ready.batches is None:
        raise APIError(503, "The Batch API is not available on this server.")
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    return ready, ready.batches, tenant.name


def _page_params(request: HTTPRequest) -> tuple[int, str | None]:
    raw = request.query_params.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        raise APIError(400, f"limit must be an integer; got {raw!r}", param="limit") from None
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100; got {limit}", param="limit")
    return limit, request.query_params.get("after")


def _list(items: list[dict[str, Any]], more: bool) -> Response:
    return json_response(
        {
            "object": "list",
            "data": items,
            "has_more": more,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
        }
    )


@router.post("/v1/files")
async def upload_file(request: HTTPRequest) -> Response:
    ready, batches, tenant = _caller(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FILE_BYTES + 65536:
        raise APIError(413, f"Files are limited to {MAX_FILE_BYTES} bytes.", code="file_too_large")
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "A multipart form with a 'file' part is required.", param="file")
        if not isinstance(purpose, str):
            raise APIError(400, "A 'purpose' field is required ('batch').", param="purpose")
        filename = upload.filename or "upload.jsonl"
        # Read from the spooled upload a megabyte at a time on a worker thread: memory
        # holds a chunk and a line, never the file.
        settings = ready.service.settings
        record = await asyncio.to_thread(
            batches.add_file_from,
            tenant,
            filename,
            purpose,
            upload.file,
            max_line_bytes=settings.max_request_body_bytes,
            quota_bytes=settings.file_storage_bytes_per_tenant,
            # A prompt that cannot fit the context is refused now, naming its line, not
            # found hours later; other errors of a line's request come back in the
            # batch's error file, as OpenAI's do.
            validate=_line_validator(ready.service),
        )
    finally:
        await form.close()
    return json_response(record.view())


def _line_validator(service: Service) -> LineValidator:
    """A batch line's request prepared as when it runs (tokenised): a 400 for a prompt
    over the context; the line's other errors are its answer when it runs."""

    def validate(url: str, body: dict[str, Any]) -> None:
        kind: Kind = "chat" if ENDPOINTS[url] == "chat" else "completion"
        try:
            prepare(service, kind, dict(body))
        except APIError as error:
            if error.code == "context_length_exceeded":
                raise

    return validate


@router.get("/v1/files")
async def list_files(request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    limit, after = _page_params(request)
    records, more = await asyncio.to_thread(batches.files, tenant, limit, after)
    return _list([r.view() for r in records], more)


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    return json_response((await asyncio.to_thread(batches.file, file_id, tenant)).view())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    record = await asyncio.to_thread(batches.file, file_id, tenant)
    return FileResponse(batches.content(record), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    await asyncio.to_thread(batches.delete_file, file_id, tenant)
    return json_response({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches")
async def create_batch(request: HTTPRequest) -> Response:
    ready, batches, tenant = _caller(request)
    body = parse_json(await read_body(request, ready.service.settings.max_request_body_bytes))
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.")
    fields = {"input_file_id": str, "endpoint": str, "completion_window": str}
    for name, kind in fields.items():
        if not isinstance(body.get(name), kind):
            raise APIError(400, f"{name} is required (a string).", param=name)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise APIError(400, "metadata must map strings to strings.", param="metadata")
    if metadata is not None:
        check_metadata(metadata)
    view = await asyncio.to_thread(
        batches.create,
        tenant,
        body["input_file_id"],
        body["endpoint"],
        body["completion_window"],
        metadata,
    )
    ready.jobs.wake()
    return json_response(view)


@router.get("/v1/batches")
async def list_batches(request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    limit, after = _page_params(request)
    views, more = await asyncio.to_thread(batches.batches, tenant, limit, after)
    return _list(views, more)


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    return json_response(await asyncio.to_thread(batches.view, batch_id, tenant))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: HTTPRequest) -> Response:
    _, batches, tenant = _caller(request)
    return json_response(await asyncio.to_thread(batches.cancel, batch_id, tenant))


#: OpenAI's bounds on ``metadata``: pairs, and characters of a key and of a value.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: dict[str, str]) -> None:
    """A 400 naming ``metadata`` past OpenAI's bounds."""
    if len(metadata) > METADATA_PAIRS:
        raise APIError(
            400,
            f"metadata holds {len(metadata)} pairs; at most {METADATA_PAIRS}.",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise APIError(
                400,
                f"metadata keys hold at most {METADATA_KEY_CHARS} characters and values "
                f"{METADATA_VALUE_CHARS}; {key[:METADATA_KEY_CHARS]!r} is longer.",
                param="metadata",
            )
