"""Background jobs: ``"background": true`` requests, journaled to SQLite and run in order.

A background request is validated and authenticated at once, written to the journal and
answered ``202`` with a job id; ``GET /v1/jobs/{id}`` tells its status and, when done,
its result (the same body a non-streamed request would have got).  A runner keeps at
most ``max_background_jobs_in_memory`` jobs in flight, each going through the front
door as a ``batch``-class request like any other, so jobs use spare capacity and never
crowd out interactive traffic; the rest wait on disk, so memory stays bounded however
many are submitted.  At startup, jobs that were running when the process died are put
back in line: every job is recorded done exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.journal import JobJournal, JobRecord, JobState
from sluicegate.admission.tenants import Tenant
from sluicegate.api.runtime import Runtime, get_runtime
from sluicegate.errors import APIError

logger = logging.getLogger(__name__)
router = APIRouter()


def default_journal_path(settings_cache_dir: str | None, port: int) -> Path:
    base = Path(settings_cache_dir).expanduser() if settings_cache_dir else (
        Path.home() / ".cache" / "sluicegate"
    )  # fmt: skip
    return base / f"jobs-{port}.sqlite3"


class JobRunner:
    """Claims journaled jobs while there is room and runs them through the front door."""

    def __init__(self, runtime: Runtime, journal: JobJournal, max_in_flight: int) -> None:
        self.runtime = runtime
        self.journal = journal
        self.max_in_flight = max_in_flight
        self._in_flight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        requeued = await asyncio.to_thread(self.journal.requeue_running)
        if requeued:
            logger.info("requeued %d background jobs interrupted by a restart", requeued)
        self._task = asyncio.create_task(self._loop(), name="sluicegate-jobs")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._in_flight) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(self.journal.close)

    async def submit(
        self, tenant: Tenant, kind: Literal["chat", "completion"], body: dict[str, Any]
    ) -> dict[str, Any]:
        job_id = f"job-{uuid.uuid4().hex}"
        payload = orjson.dumps({"kind": kind, "body": body}).decode()
        record = await asyncio.to_thread(self.journal.submit, job_id, tenant.name, payload)
        self._wake.set()
        return job_view(record)

    async def get(self, job_id: str, tenant: Tenant) -> dict[str, Any]:
        record = await asyncio.to_thread(self.journal.get, job_id)
        if record is None or record.tenant != tenant.name:
            # Another tenant's job id is indistinguishable from an unknown one.
            raise APIError(404, f"No job with id '{job_id}'.", param="job_id", code="not_found")
        return job_view(record)

    async def _loop(self) -> None:
        while True:
            while len(self._in_flight) < self.max_in_flight:
                record = await asyncio.to_thread(self.journal.claim_next)
                if record is None:
                    break
                task = asyncio.create_task(self._run(record))
                self._in_flight.add(task)
                task.add_done_callback(self._done)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._wake.set()

    async def _run(self, record: JobRecord) -> None:
        from sluicegate.api.openai_routes import admit, collect, prepare, response_body

        runtime = self.runtime
        payload = orjson.loads(record.body_json)
        front_door = runtime.front_door
        assert front_door is not None
        tenant = front_door.registry.get(record.tenant)
        if tenant is None:
            await asyncio.to_thread(
                self.journal.fail, record.job_id, f"tenant {record.tenant!r} no longer exists"
            )
            return
        while True:
            try:
                prepared = prepare(runtime, payload["kind"], dict(payload["body"]))
                generation = await admit(runtime, tenant, prepared, priority="batch")
                output = await collect(runtime, generation, None)
            except APIError as exc:
                retry_after = exc.headers.get("retry-after")
                if retry_after is not None and exc.status_code in (429, 503):
                    # Refused for now (limits, full queue, breaker): the job waits its turn.
                    await asyncio.sleep(float(retry_after))
                    continue
                await asyncio.to_thread(self.journal.fail, record.job_id, exc.message)
                return
            result = orjson.dumps(response_body(runtime, prepared, generation, output)).decode()
            await asyncio.to_thread(self.journal.complete, record.job_id, result)
            return


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
    runtime = get_runtime(request)
    if runtime.front_door is None or runtime.jobs is None:
        raise APIError(503, "The server is starting; retry shortly.", headers={"retry-after": "2"})
    tenant = runtime.front_door.authenticate(request.headers.get("authorization"))
    view = await runtime.jobs.get(job_id, tenant)
    return Response(orjson.dumps(view), media_type="application/json")


def open_journal(runtime: Runtime, port: int) -> JobJournal:
    settings = runtime.settings
    path = (
        Path(settings.journal_path)
        if settings.journal_path
        else default_journal_path(settings.cache_dir, port)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    journal = JobJournal(path)
    logger.info("job journal %s opened in %.3fs", path, time.monotonic() - started)
    return journal
