"""The job runner's limits: size, unfinished jobs per tenant, and purging after retention."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sluicegate.errors import APIError
from sluicegate.queue.jobs import JobLimits, JobRunner
from sluicegate.queue.journal import JobJournal, JobRecord, JobState
from tests.fake_clock import FakeClock


async def echo(record: JobRecord) -> str:
    return '{"ok": true}'


async def wait_for(condition: object, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds; only a broken runner misses the deadline."""
    assert callable(condition)
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


async def test_a_job_over_max_job_bytes_is_413(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path / "jobs.db")
    runner = JobRunner(journal, 1, echo, JobLimits(max_job_bytes=1024))
    with pytest.raises(APIError) as refused:
        await runner.submit("t", "x" * 1025)
    assert refused.value.status_code == 413 and refused.value.code == "job_too_large"
    assert journal.count() == 0
    await runner.submit("t", "x" * 1024)
    journal.close()


async def test_unfinished_jobs_per_tenant_are_capped(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path / "jobs.db")
    runner = JobRunner(journal, 1, echo, JobLimits(max_unfinished_jobs_per_tenant=3))
    for _ in range(3):
        await runner.submit("busy", "{}")
    with pytest.raises(APIError) as refused:
        await runner.submit("busy", "{}")
    assert refused.value.status_code == 429 and "retry-after" in refused.value.headers
    await runner.submit("other", "{}")  # another tenant is not affected
    journal.close()


async def test_finished_jobs_are_purged_after_the_retention_time(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    journal = JobJournal(tmp_path / "jobs.db", clock)
    runner = JobRunner(journal, 4, echo, JobLimits(retention_seconds=100.0), clock=clock)
    await runner.start()
    try:
        old = await runner.submit("t", "{}")
        await wait_for(lambda: journal.count(JobState.DONE) == 1)
        clock.advance(60.0)
        recent = await runner.submit("t", "{}")
        await wait_for(lambda: journal.count(JobState.DONE) == 2)
        clock.advance(50.0)  # the first finished 110 s ago, the second 50 s ago
        assert await runner.purge() == 1
        with pytest.raises(APIError) as gone:
            await runner.get(old.job_id, "t")
        assert gone.value.status_code == 404
        assert (await runner.get(recent.job_id, "t")).state is JobState.DONE
    finally:
        await runner.stop()


async def test_the_runner_purges_by_itself(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    journal = JobJournal(tmp_path / "jobs.db", clock)
    runner = JobRunner(journal, 4, echo, JobLimits(retention_seconds=10.0), clock=clock)
    await runner.start()
    try:
        await runner.submit("t", "{}")
        await wait_for(lambda: journal.count(JobState.DONE) == 1)
        clock.advance(11.0)  # past the retention and the purge interval (1 s here)
        runner._wake.set()
        await wait_for(lambda: journal.count() == 0)
    finally:
        await runner.stop()


def test_purging_gives_the_space_back(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    path = tmp_path / "jobs.db"
    with JobJournal(path, clock) as journal:
        for n in range(40):
            journal.submit(f"job-{n}", "t", "x" * 100_000)
            claimed = journal.claim_next()
            assert claimed is not None
            journal.complete(claimed.job_id, "{}")
        journal._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        full = os.path.getsize(path)
        clock.advance(10.0)
        assert journal.purge_finished(clock()) == 40
        journal._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert os.path.getsize(path) < full / 4, (full, os.path.getsize(path))


async def test_the_rate_limits_are_charged_only_for_a_job_that_fits(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path / "jobs.db")
    runner = JobRunner(journal, 1, echo, JobLimits(max_job_bytes=1024))
    charged: list[str] = []

    async def charge() -> None:
        charged.append("charged")

    async def refuse() -> None:
        raise APIError(429, "over the tenant's tokens_per_minute")

    with pytest.raises(APIError):
        await runner.submit("t", "x" * 2000, charge=charge)
    assert charged == []  # too large: refused before the tenant is charged
    with pytest.raises(APIError) as refused:
        await runner.submit("t", "{}", charge=refuse)
    assert refused.value.status_code == 429 and journal.count() == 0
    await runner.submit("t", "{}", charge=charge)
    assert charged == ["charged"] and journal.count() == 1
    journal.close()
