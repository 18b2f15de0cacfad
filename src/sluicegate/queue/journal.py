"""A crash-safe journal of background batch jobs (``"background": true``), in SQLite.

States::

    queued ──claim_next()──► running ──complete()──► done
                                │    └───fail()─────► failed
                                └──requeue_running() at startup──► queued

Every state change is its own transaction, committed with ``synchronous=FULL`` in WAL
mode, so once a call returns the change survives a crash or power loss.  At startup
:meth:`JobJournal.requeue_running` puts back the jobs that were running when the
process died; :meth:`JobJournal.claim_next` only ever takes ``queued`` jobs, and
:meth:`JobJournal.complete` only finishes ``running`` ones, so a job is recorded done
exactly once and a done job is never run again.  (A crash *after* the engine finished
but *before* ``complete`` committed reruns that job: execution is at-least-once, the
recorded completion exactly-once.  ``attempts`` counts the runs.)

Calls block on ``fsync``: from the event loop, run them in a worker thread
(``asyncio.to_thread``).  One instance may be shared between threads; several processes
may open the same file (claims take SQLite's write lock, so no job is claimed twice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed')),
    body_json TEXT NOT NULL,
    result_json TEXT,
    error TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, seq);
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, state);
"""

#: Columns added since the first schema (a journal written before gets them at open):
#: the lines of a Batch API batch are jobs too (``queue/batches.py``).
_ADDED_COLUMNS = {"batch_id": "TEXT", "custom_id": "TEXT", "line": "INTEGER"}

_COLUMNS = (
    "job_id, tenant, state, body_json, result_json, error, attempts, created_at, updated_at, "
    "batch_id"
)


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in (JobState.DONE, JobState.FAILED)


@dataclass(slots=True, frozen=True)
class JobRecord:
    """One job as stored.  Times are wall-clock seconds (they outlive the process)."""

    job_id: str
    tenant: str
    state: JobState
    body_json: str
    result_json: str | None
    error: str | None
    attempts: int
    created_at: float
    updated_at: float
    #: The batch it is a line of (None: a single background job).
    batch_id: str | None = None


class JobExistsError(ValueError):
    """A job with this id was already submitted."""


def _record(row: tuple[Any, ...]) -> JobRecord:
    job_id, tenant, state, body, result, error, attempts, created, updated, batch = row
    return JobRecord(
        job_id=str(job_id),
        tenant=str(tenant),
        state=JobState(str(state)),
        body_json=str(body),
        result_json=None if result is None else str(result),
        error=None if error is None else str(error),
        attempts=int(attempts),
        created_at=float(created),
        updated_at=float(updated),
        batch_id=None if batch is None else str(batch),
    )


class JobJournal:
    """See the module docstring.  ``clock`` is wall time: records outlive the process."""

    def __init__(
        self,
        path: str | Path,
        clock: Callable[[], float] = time.time,
        *,
        busy_timeout_seconds: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        # Autocommit mode: every transaction below is explicit (BEGIN IMMEDIATE).
        self._db = sqlite3.connect(
            self.path,
            timeout=busy_timeout_seconds,
            isolation_level=None,
            check_same_thread=False,
        )
        # Pages freed by purge_finished go back to the file system (only takes effect on
        # a new file: an existing one keeps its mode and reuses its free pages).
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: each commit fsyncs the WAL, so an acknowledged state change survives power
        # loss (NORMAL would only survive a process crash).
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_by_batch ON jobs (batch_id, line)")

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        """The journal's connection, held under its lock: for the tables that live beside
        the jobs (the Batch API's files and batches, ``queue/batches.py``)."""
        with self._lock:
            yield self._db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> JobJournal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def submit(self, job_id: str, tenant: str, body_json: str) -> JobRecord:
        """Record a new queued job; raises :class:`JobExistsError` for a reused id."""
        now = self._clock()
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO jobs (job_id, tenant, state, body_json, created_at, updated_at)"
                    " VALUES (?, ?, 'queued', ?, ?, ?)",
                    (job_id, tenant, body_json, now, now),
                )
            except sqlite3.IntegrityError as exc:
                raise JobExistsError(f"job {job_id!r} already exists; job ids are unique") from exc
        return JobRecord(job_id, tenant, JobState.QUEUED, body_json, None, None, 0, now, now)

    def claim_next(self) -> JobRecord | None:
        """Atomically mark the oldest queued job running and return it (``None``: none)."""
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    f"SELECT {_COLUMNS} FROM jobs WHERE state = 'queued' ORDER BY seq LIMIT 1"
                ).fetchone()
                if row is None:
                    self._db.execute("COMMIT")
                    return None
                self._db.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, updated_at = ?"
                    " WHERE job_id = ?",
                    (now, row[0]),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        claimed = _record(row)
        return dataclasses.replace(
            claimed, state=JobState.RUNNING, attempts=claimed.attempts + 1, updated_at=now
        )

    def complete(self, job_id: str, result_json: str) -> bool:
        """Mark a running job done with its result; ``False`` if it was not running."""
        return self._finish(job_id, JobState.DONE, result_json, None)

    def fail(self, job_id: str, error: str) -> bool:
        """Mark a running job failed; ``False`` if it was not running."""
        return self._finish(job_id, JobState.FAILED, None, error)

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,)
            ).fetchone()
        return None if row is None else _record(row)

    def requeue_running(self) -> int:
        """Put jobs left running by a dead process back in the queue (call at startup).

        Only safe while no live worker of this journal is running jobs.  Returns how many.
        """
        now = self._clock()
        with self._lock:
            cursor = self._db.execute(
                "UPDATE jobs SET state = 'queued', updated_at = ? WHERE state = 'running'",
                (now,),
            )
        return cursor.rowcount

    def unfinished(self) -> list[JobRecord]:
        """Every job queued or running, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE state IN ('queued', 'running')"
                " ORDER BY created_at"
            ).fetchall()
        return [_record(row) for row in rows]

    def count(self, state: JobState | None = None) -> int:
        with self._lock:
            if state is None:
                row = self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()
            else:
                row = self._db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE state = ?", (state.value,)
                ).fetchone()
        return int(row[0])

    def count_unfinished(self, tenant: str) -> int:
        """The tenant's single jobs queued or running (batch lines have their own limits)."""
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE tenant = ? AND state IN ('queued', 'running')"
                " AND batch_id IS NULL",
                (tenant,),
            ).fetchone()
        return int(row[0])

    def purge_finished(self, finished_before: float) -> int:
        """Delete done and failed jobs last updated before ``finished_before`` (wall time)
        and give the space back.  A batch's lines are its own to delete, when its output
        file is written."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM jobs WHERE state IN ('done', 'failed') AND updated_at < ?"
                " AND batch_id IS NULL",
                (finished_before,),
            )
            if cursor.rowcount:
                # executescript steps it to the end (execute would free one page).
                self._db.executescript("PRAGMA incremental_vacuum;")
        return cursor.rowcount

    def _finish(
        self, job_id: str, state: JobState, result_json: str | None, error: str | None
    ) -> bool:
        now = self._clock()
        with self._lock:
            cursor = self._db.execute(
                "UPDATE jobs SET state = ?, result_json = ?, error = ?, updated_at = ?"
                " WHERE job_id = ? AND state = 'running'",
                (state.value, result_json, error, now, job_id),
            )
        return cursor.rowcount == 1
