from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from sluicegate.queue.journal import JobExistsError, JobJournal, JobState
from tests.fake_clock import FakeClock


def _body(n: int) -> str:
    return json.dumps({"model": "m", "prompt": f"job {n}", "background": True})


def test_lifecycle_fifo_and_results(tmp_path: Path) -> None:
    clock = FakeClock(1_700_000_000.0)
    with JobJournal(tmp_path / "jobs.db", clock) as journal:
        for n in range(3):
            clock.advance(1.0)
            record = journal.submit(f"job-{n}", "acme", _body(n))
            assert record.state is JobState.QUEUED
        with pytest.raises(JobExistsError, match="'job-1' already exists"):
            journal.submit("job-1", "acme", _body(1))

        first = journal.claim_next()
        assert first is not None and first.job_id == "job-0"
        assert first.state is JobState.RUNNING and first.attempts == 1
        second = journal.claim_next()
        assert second is not None and second.job_id == "job-1"

        assert journal.complete("job-0", '{"text": "done"}')
        assert not journal.complete("job-0", '{"text": "again"}')  # done stays done
        assert journal.fail("job-1", "engine error: out of memory")
        assert not journal.complete("job-2", "{}")  # still queued: not running

        done = journal.get("job-0")
        assert done is not None and done.state is JobState.DONE
        assert done.result_json == '{"text": "done"}' and done.state.is_finished
        failed = journal.get("job-1")
        assert failed is not None and failed.state is JobState.FAILED
        assert failed.error == "engine error: out of memory"
        assert journal.get("nope") is None
        assert journal.count() == 3 and journal.count(JobState.QUEUED) == 1

        third = journal.claim_next()
        assert third is not None and third.job_id == "job-2"
        assert journal.claim_next() is None


def test_wal_and_full_sync(tmp_path: Path) -> None:
    with JobJournal(tmp_path / "jobs.db") as journal:
        assert journal._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert journal._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_second_connection_sees_every_committed_change(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobJournal(path) as writer, JobJournal(path) as reader:
        writer.submit("j1", "t", _body(1))
        writer.submit("j2", "t", _body(2))
        seen = reader.get("j1")
        assert seen is not None and seen.state is JobState.QUEUED
        # Two workers never claim the same job.
        a = writer.claim_next()
        b = reader.claim_next()
        assert a is not None and b is not None and {a.job_id, b.job_id} == {"j1", "j2"}
        assert reader.claim_next() is None
        writer.complete(a.job_id, "{}")
        seen = reader.get(a.job_id)
        assert seen is not None and seen.state is JobState.DONE
    # A plain sqlite3 view agrees.
    with sqlite3.connect(path) as raw:
        states = dict(raw.execute("SELECT job_id, state FROM jobs").fetchall())
    assert states == {a.job_id: "done", b.job_id: "running"}


def _run_worker(journal: JobJournal, runs: Counter[str], stop_after: int | None = None) -> None:
    """Claim and finish jobs; with ``stop_after``, 'crash' holding one claimed job."""
    finished = 0
    while (job := journal.claim_next()) is not None:
        runs[job.job_id] += 1
        if stop_after is not None and finished == stop_after:
            return  # dies mid-job: claimed, never completed
        assert journal.complete(job.job_id, json.dumps({"echo": json.loads(job.body_json)}))
        finished += 1


def test_restart_completes_every_job_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    runs: Counter[str] = Counter()
    journal = JobJournal(path)
    for n in range(10):
        journal.submit(f"job-{n}", "batchy", _body(n))
    _run_worker(journal, runs, stop_after=4)
    journal.close()  # the process is gone; job-4 was running

    requeued = []
    for _ in range(2):  # restart twice: the second restart finds nothing to redo
        with JobJournal(path) as reopened:
            requeued.append(reopened.requeue_running())
            _run_worker(reopened, runs)
    assert requeued == [1, 0]

    with JobJournal(path) as check:
        for n in range(10):
            record = check.get(f"job-{n}")
            assert record is not None and record.state is JobState.DONE
            assert json.loads(record.result_json or "")["echo"]["prompt"] == f"job {n}"
            assert record.attempts == (2 if n == 4 else 1)
    # Done jobs never ran again; only the interrupted one ran twice.
    assert runs == {f"job-{n}": (2 if n == 4 else 1) for n in range(10)}


def test_a_killed_process_leaves_its_job_running_and_restart_requeues_it(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with JobJournal(path) as journal:
        journal.submit("a", "t", _body(1))
        journal.submit("b", "t", _body(2))
    child = textwrap.dedent(
        f"""
        import os
        from sluicegate.queue.journal import JobJournal
        journal = JobJournal({str(path)!r})
        job = journal.claim_next()
        assert job is not None and job.job_id == "a"
        os._exit(3)  # no complete, no close: a crash
        """
    )
    result = subprocess.run([sys.executable, "-c", child], timeout=60, check=False)
    assert result.returncode == 3
    with JobJournal(path) as journal:
        crashed = journal.get("a")
        assert crashed is not None and crashed.state is JobState.RUNNING
        assert journal.requeue_running() == 1
        runs: Counter[str] = Counter()
        _run_worker(journal, runs)
        assert runs == {"a": 1, "b": 1}
        assert journal.count(JobState.DONE) == 2


def test_purge_finished(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    with JobJournal(tmp_path / "jobs.db", clock) as journal:
        journal.submit("old", "t", "{}")
        journal.claim_next()
        journal.complete("old", "{}")
        clock.advance(100.0)
        journal.submit("new", "t", "{}")
        assert journal.purge_finished(finished_before=1050.0) == 1
        assert journal.get("old") is None and journal.get("new") is not None
