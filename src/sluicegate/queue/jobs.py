"""Background jobs: journaled to SQLite and run in order, a bounded number at a time.

A background request is validated and authenticated at once, written to the journal and
answered ``202`` with a job id.  The runner keeps at most ``max_in_flight`` jobs in
flight, each executed like any other request (as ``batch``-class work, so jobs use spare
capacity and never crowd out interactive traffic); the rest wait on disk, so memory
stays bounded however many are submitted.  A job refused for now (``429``/``503`` with
``Retry-After``) waits that long and tries again.  At startup, jobs that were running
when the process died are put back in line: every job is recorded done exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from sluicegate.errors import APIError
from sluicegate.queue.journal import JobJournal, JobRecord

logger = logging.getLogger(__name__)

#: Runs one job to its result (JSON text); raises :class:`APIError` when it cannot.
JobExecutor = Callable[[JobRecord], Awaitable[str]]
#: Told when a job is recorded done or failed (a batch finishes with its last line), and
#: once a second (``None``: time for periodic work, such as expiring batches).
JobListener = Callable[[JobRecord | None], Awaitable[None]]


@dataclass(slots=True, frozen=True)
class JobLimits:
    """What the journal holds at most (see the module docstring)."""

    max_job_bytes: int = 256 * 1024
    max_unfinished_jobs_per_tenant: int = 1000
    retention_seconds: float = 86400.0


def open_journal(path: Path) -> JobJournal:
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    journal = JobJournal(path)
    logger.info("job journal %s opened in %.3fs", path, time.monotonic() - started)
    return journal


class JobRunner:
    """Claims journaled jobs while there is room and runs them with ``execute``."""

    def __init__(
        self,
        journal: JobJournal,
        max_in_flight: int,
        execute: JobExecutor,
        limits: JobLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.journal = journal
        self.max_in_flight = max_in_flight
        self.limits = limits or JobLimits()
        self._execute = execute
        self._clock = clock
        self._in_flight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._purged_at = -float("inf")
        self.listener: JobListener | None = None
        self._ticked_at = -float("inf")

    async def start(self) -> None:
        requeued = await asyncio.to_thread(self.journal.requeue_running)
        if requeued:
            logger.info("requeued %d background jobs interrupted by a restart", requeued)
        await self._tell(None)  # e.g. a batch whose last line ended just before a crash
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
        self,
        tenant_name: str,
        payload_json: str,
        charge: Callable[[], Awaitable[None]] | None = None,
        job_id: str | None = None,
    ) -> JobRecord:
        """Journal a job (durably) and wake the runner; 413/429 past the limits.

        ``charge`` (the tenant's rate limits) is awaited once the job is known to fit,
        just before it is journaled; what it raises refuses the job.  ``job_id``: the
        job's id when it has one already (a background response's), else a new one."""
        limits = self.limits
        size = len(payload_json.encode())
        if size > limits.max_job_bytes:
            raise APIError(
                413,
                f"This background job is {size} bytes once validated; the limit is "
                f"{limits.max_job_bytes} bytes (max_job_bytes). Shorten the prompt.",
                code="job_too_large",
            )
        unfinished = await asyncio.to_thread(self.journal.count_unfinished, tenant_name)
        if unfinished >= limits.max_unfinished_jobs_per_tenant:
            raise APIError(
                429,
                f"Tenant {tenant_name!r} already has {unfinished} background jobs queued "
                f"or running, its limit (max_unfinished_jobs_per_tenant). Retry when some "
                "have finished.",
                code="too_many_jobs",
                headers={"retry-after": "10"},
            )
        if charge is not None:
            await charge()
        job_id = job_id or f"job-{uuid.uuid4().hex}"
        record = await asyncio.to_thread(self.journal.submit, job_id, tenant_name, payload_json)
        self._wake.set()
        return record

    def wake(self) -> None:
        """New jobs were journaled (a batch's lines): claim them now."""
        self._wake.set()

    async def get(self, job_id: str, tenant_name: str) -> JobRecord:
        """The tenant's job; another tenant's job id is indistinguishable from an unknown one."""
        record = await asyncio.to_thread(self.journal.get, job_id)
        if record is None or record.tenant != tenant_name:
            raise APIError(
                404,
                f"No job with id '{job_id}' (finished jobs are kept "
                f"{self.limits.retention_seconds:g}s).",
                param="job_id",
                code="not_found",
            )
        return record

    async def purge(self) -> int:
        """Delete the jobs that finished more than ``retention_seconds`` ago; how many."""
        self._purged_at = self._clock()
        before = self._purged_at - self.limits.retention_seconds
        purged = await asyncio.to_thread(self.journal.purge_finished, before)
        if purged:
            logger.info("purged %d finished background jobs", purged)
        return purged

    async def _loop(self) -> None:
        # Purge about ten times per retention period, at most once a minute.
        purge_interval = min(60.0, self.limits.retention_seconds / 10)
        while True:
            if self._clock() - self._purged_at >= purge_interval:
                await self.purge()
            while len(self._in_flight) < self.max_in_flight:
                record = await asyncio.to_thread(self.journal.claim_next)
                if record is None:
                    break
                task = asyncio.create_task(self._run(record))
                self._in_flight.add(task)
                task.add_done_callback(self._done)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            if self._clock() - self._ticked_at >= 1.0:
                self._ticked_at = self._clock()
                await self._tell(None)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._wake.set()

    async def _run(self, record: JobRecord) -> None:
        while True:
            try:
                result = await self._execute(record)
            except APIError as exc:
                retry_after = exc.headers.get("retry-after")
                if retry_after is not None and exc.status_code in (429, 503):
                    # Refused for now (limits, full queue, breaker): the job waits its turn.
                    await asyncio.sleep(float(retry_after))
                    continue
                await asyncio.to_thread(self.journal.fail, record.job_id, exc.message)
                break
            await asyncio.to_thread(self.journal.complete, record.job_id, result)
            break
        await self._tell(record)

    async def _tell(self, record: JobRecord | None) -> None:
        if self.listener is None:
            return
        try:
            await self.listener(record)
        except Exception:  # a listener's failure must not stop the jobs
            logger.exception("background job listener failed")
