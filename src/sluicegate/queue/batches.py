"""The OpenAI Batch API's state: uploaded files and batches, kept beside the job journal.

- **Files** (``POST /v1/files``, purpose ``batch``) are checked line by line when they
  are uploaded, then written to disk (a temporary file, fsynced, renamed). Their
  metadata goes in the journal's database.
- **A batch** (``POST /v1/batches``) is inserted in one transaction with one job per line
  of its file, so it exists with all its lines or not at all. The job runner runs the
  lines as it runs any background job (:mod:`sluicegate.queue.jobs`): in the ``batch``
  class, on idle capacity, at most ``max_background_jobs_in_memory`` at a time, with the
  rest on disk and put back in line after a crash. Each line is recorded done exactly
  once.
- **When its last line is recorded**, the batch is finalized. Its output and error files
  are written from the lines' results, in line order. Then, in one transaction, the
  batch is marked with its outcome and counts and its lines are deleted. A crash between
  the two finalizes it again and writes the same files under the same ids.
- **Cancelling** deletes the lines still queued (they never run); the running ones
  finish, and the batch is then finalized as ``cancelled``. A batch still running when
  its completion window ends is finalized the same way, as ``expired``.

Calls block on SQLite and the disk: from the event loop, run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from sluicegate.errors import APIError
from sluicegate.queue.batch_format import (
    ENDPOINTS,
    FileRecord,
    LineValidator,
    batch_view,
    check_batch_lines,
    check_size,
    copy_checked,
    result_line,
)
from sluicegate.queue.journal import JobJournal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    ending TEXT,
    metadata_json TEXT,
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    cancelling_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, created_at);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
"""

#: Endpoints a batch may run, and the kind of request each line is.
COMPLETION_WINDOWS = {"24h": 86400.0}
_UNFINISHED = ("in_progress", "cancelling")


def _not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No {what} with id '{ident}'.", code="not_found")


class Batches:
    """Files and batches of every tenant (see the module docstring)."""

    def __init__(
        self, journal: JobJournal, files_dir: Path, clock: Callable[[], float] = time.time
    ) -> None:
        self.journal = journal
        self.files_dir = files_dir
        self._clock = clock
        #: One finalizer at a time: the last lines of a batch end on several threads at
        #: once, and each asks to finalize it (the journal is this process's alone).
        self._finalizing = threading.Lock()
        #: Uploads store one at a time (a tenant's quota is checked against what is stored).
        self._storing = threading.Lock()
        files_dir.mkdir(parents=True, exist_ok=True)
        with journal.connection() as db:
            db.executescript(_SCHEMA)

    # ------------------------------------------------------------------ files
    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileRecord:
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch'; got {purpose!r}", param="purpose")
        check_batch_lines(data)
        record = FileRecord(
            f"file-{uuid.uuid4().hex}", tenant, purpose, filename, len(data), self._clock()
        )
        self._write(record.file_id, [data])
        self._insert_file(record)
        return record

    def add_file_from(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        source: BinaryIO,
        *,
        max_line_bytes: int,
        quota_bytes: int,
        validate: LineValidator | None = None,
    ) -> FileRecord:
        """Store an upload read from ``source`` a megabyte at a time, its lines checked as
        they come (``validate``: each line's request as the server would run it): memory
        holds a chunk and one line, never the file.  A 413 past ``MAX_FILE_BYTES``, a
        line past ``max_line_bytes`` or the tenant's ``quota_bytes`` of stored files; a
        400 naming the first bad line."""
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch'; got {purpose!r}", param="purpose")
        record = FileRecord(f"file-{uuid.uuid4().hex}", tenant, purpose, filename, 0, 0.0)
        path = self.files_dir / f"{record.file_id}.jsonl"
        tmp = path.with_suffix(".upload")
        used = self._stored_bytes(tenant)
        try:
            with tmp.open("wb") as out:
                size = copy_checked(
                    source,
                    out,
                    max_line_bytes,
                    lambda n: check_size(n, used, quota_bytes),
                    validate,
                )
                out.flush()
                os.fsync(out.fileno())
            with self._storing:  # the quota, checked again with any upload beside it
                check_size(size, self._stored_bytes(tenant), quota_bytes)
                tmp.replace(path)
                record = FileRecord(record.file_id, tenant, purpose, filename, size, self._clock())
                self._insert_file(record)
        finally:
            tmp.unlink(missing_ok=True)
        return record

    def _stored_bytes(self, tenant: str) -> int:
        with self.journal.connection() as db:
            row = db.execute("SELECT SUM(bytes) FROM files WHERE tenant = ?", (tenant,))
            return int(row.fetchone()[0] or 0)

    def file(self, file_id: str, tenant: str) -> FileRecord:
        with self.journal.connection() as db:
            row = db.execute(
                "SELECT file_id, tenant, purpose, filename, bytes, created_at FROM files"
                " WHERE file_id = ?",
                (file_id,),
            ).fetchone()
        if row is None or row[1] != tenant:
            raise _not_found("file", file_id)
        return FileRecord(*row)

    def files(self, tenant: str, limit: int, after: str | None) -> tuple[list[FileRecord], bool]:
        """The tenant's files, newest first, ``limit`` after the file ``after``."""
        return self._page(
            "SELECT file_id, tenant, purpose, filename, bytes, created_at FROM files",
            "file_id",
            FileRecord,
            tenant,
            limit,
            after,
        )

    def content(self, record: FileRecord) -> Path:
        return self.files_dir / f"{record.file_id}.jsonl"

    def delete_file(self, file_id: str, tenant: str) -> None:
        record = self.file(file_id, tenant)
        with self.journal.connection() as db:
            db.execute("DELETE FROM files WHERE file_id = ?", (file_id,))
        with contextlib.suppress(FileNotFoundError):
            self.content(record).unlink()

    # ---------------------------------------------------------------- batches
    def create(
        self,
        tenant: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise APIError(
                400,
                f"endpoint must be one of {sorted(ENDPOINTS)}; got {endpoint!r}",
                param="endpoint",
            )
        window = COMPLETION_WINDOWS.get(completion_window)
        if window is None:
            raise APIError(
                400,
                f"completion_window must be '24h'; got {completion_window!r}",
                param="completion_window",
            )
        source = self.file(input_file_id, tenant)
        lines = []
        for raw in self.content(source).read_bytes().splitlines():
            if raw.strip():
                line = orjson.loads(raw)
                if line["url"] != endpoint:
                    raise APIError(
                        400,
                        f"Request {line['custom_id']!r} is for {line['url']}, not the "
                        f"batch's endpoint {endpoint}.",
                        param="endpoint",
                    )
                lines.append(line)
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = self._clock()
        kind = ENDPOINTS[endpoint]
        with self.journal.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO batches (batch_id, tenant, endpoint, input_file_id,"
                    " completion_window, status, metadata_json, total, created_at, expires_at)"
                    " VALUES (?, ?, ?, ?, ?, 'in_progress', ?, ?, ?, ?)",
                    (
                        batch_id,
                        tenant,
                        endpoint,
                        input_file_id,
                        completion_window,
                        orjson.dumps(metadata).decode() if metadata else None,
                        len(lines),
                        now,
                        now + window,
                    ),
                )
                db.executemany(
                    "INSERT INTO jobs (job_id, tenant, state, body_json, created_at, updated_at,"
                    " batch_id, custom_id, line) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                    (
                        (
                            f"job-{uuid.uuid4().hex}",
                            tenant,
                            orjson.dumps({"kind": kind, "body": line["body"]}).decode(),
                            now,
                            now,
                            batch_id,
                            line["custom_id"],
                            index,
                        )
                        for index, line in enumerate(lines)
                    ),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return self.view(batch_id, tenant)

    def view(self, batch_id: str, tenant: str) -> dict[str, Any]:
        """The batch in OpenAI's shape, its counts as of now."""
        with self.journal.connection() as db:
            row = db.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches WHERE batch_id = ?", (batch_id,)
            ).fetchone()
            if row is None or row[1] != tenant:
                raise _not_found("batch", batch_id)
            counts = _line_counts(db, batch_id) if row[5] in _UNFINISHED else None
        return batch_view(row, counts)

    def batches(
        self, tenant: str, limit: int, after: str | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """The tenant's batches, newest first, ``limit`` after the batch ``after``."""
        query = "SELECT batch_id FROM batches"
        ids, more = self._page(query, "batch_id", str, tenant, limit, after)
        return [self.view(batch_id, tenant) for batch_id in ids], more

    def cancel(self, batch_id: str, tenant: str, ending: str = "cancelled") -> dict[str, Any]:
        """Stop a batch: its queued lines are dropped, the running ones finish."""
        view = self.view(batch_id, tenant)  # 404 for another tenant's
        if view["status"] in ("completed", "failed", "expired", "cancelled"):
            raise APIError(
                409,
                f"Batch {batch_id} is {view['status']}: only a batch in progress can be cancelled.",
                code="batch_not_cancellable",
            )
        if view["status"] == "in_progress":
            with self.journal.connection() as db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("DELETE FROM jobs WHERE batch_id = ? AND state = 'queued'", (batch_id,))
                db.execute(
                    "UPDATE batches SET status = 'cancelling', ending = ?, cancelling_at = ?"
                    " WHERE batch_id = ?",
                    (ending, self._clock(), batch_id),
                )
                db.execute("COMMIT")
            self.finish_if_done(batch_id)
        return self.view(batch_id, tenant)

    def sweep(self) -> int:
        """Expire batches past their window, and finalize any batch whose lines have all
        been recorded (after a crash, say).  Returns how many were finalized."""
        now = self._clock()
        with self.journal.connection() as db:
            rows = db.execute(
                "SELECT batch_id, tenant, status, expires_at FROM batches"
                " WHERE status IN ('in_progress', 'cancelling')"
            ).fetchall()
        finished = 0
        for batch_id, tenant, status, expires_at in rows:
            if status == "in_progress" and now >= expires_at:
                self.cancel(batch_id, tenant, ending="expired")
            finished += int(self.finish_if_done(batch_id))
        return finished

    def finish_if_done(self, batch_id: str) -> bool:
        """Finalize the batch if none of its lines is queued or running any more: its
        output files written once, by whichever caller comes first (the others find it
        finished).  True for that caller."""
        with self._finalizing:
            return self._finish_if_done(batch_id)

    def _finish_if_done(self, batch_id: str) -> bool:
        with self.journal.connection() as db:
            row = db.execute(
                "SELECT status, ending FROM batches WHERE batch_id = ?", (batch_id,)
            ).fetchone()
            if row is None or row[0] not in _UNFINISHED:
                return False
            unfinished = db.execute(
                "SELECT COUNT(*) FROM jobs WHERE batch_id = ? AND state IN ('queued', 'running')",
                (batch_id,),
            ).fetchone()[0]
            if unfinished:
                return False
            counts = _line_counts(db, batch_id)
        hex_id = batch_id.removeprefix("batch_")
        outputs: dict[str, list[bytes]] = {"output": [], "errors": []}
        for custom_id, job_id, state, result, error in self._lines(batch_id):
            ok, entry = result_line(custom_id, job_id, state, result, error)
            outputs["output" if ok else "errors"].append(entry)
        now = self._clock()
        file_ids: dict[str, str | None] = {}
        for which, entries in outputs.items():
            if not entries:
                file_ids[which] = None
                continue
            file_id = f"file-{hex_id}-{which}"
            size = self._write(file_id, entries)
            self._insert_file(
                FileRecord(
                    file_id,
                    self._tenant(batch_id),
                    "batch_output",
                    f"{batch_id}_{which}.jsonl",
                    size,
                    now,
                )
            )
            file_ids[which] = file_id
        status = row[1] or "completed"
        with self.journal.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE batches SET status = ?, completed = ?, failed = ?, output_file_id = ?,"
                " error_file_id = ?, finished_at = ? WHERE batch_id = ?",
                (
                    status,
                    counts["completed"],
                    counts["failed"],
                    file_ids["output"],
                    file_ids["errors"],
                    now,
                    batch_id,
                ),
            )
            db.execute("DELETE FROM jobs WHERE batch_id = ?", (batch_id,))
            db.execute("COMMIT")
        return True

    # --------------------------------------------------------------- helpers
    def _tenant(self, batch_id: str) -> str:
        with self.journal.connection() as db:
            row = db.execute("SELECT tenant FROM batches WHERE batch_id = ?", (batch_id,))
            return str(row.fetchone()[0])

    def _lines(self, batch_id: str, page: int = 1000) -> Iterator[tuple[Any, ...]]:
        """The batch's recorded lines in order, a page at a time (the lock is not held
        for the whole batch)."""
        last = -1
        while True:
            with self.journal.connection() as db:
                rows = db.execute(
                    "SELECT line, custom_id, job_id, state, result_json, error FROM jobs"
                    " WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?",
                    (batch_id, last, page),
                ).fetchall()
            if not rows:
                return
            for row in rows:
                yield row[1:]
            last = rows[-1][0]

    def _write(self, file_id: str, chunks: list[bytes]) -> int:
        """Write a file durably: temporary name, fsync, rename, fsync the directory."""
        path = self.files_dir / f"{file_id}.jsonl"
        tmp = path.with_suffix(".tmp")
        size = 0
        with tmp.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fd = os.open(self.files_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def _insert_file(self, record: FileRecord) -> None:
        with self.journal.connection() as db:
            db.execute(
                "INSERT OR REPLACE INTO files (file_id, tenant, purpose, filename, bytes,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    record.file_id,
                    record.tenant,
                    record.purpose,
                    record.filename,
                    record.bytes,
                    record.created_at,
                ),
            )

    def _page(
        self, select: str, key: str, make: Any, tenant: str, limit: int, after: str | None
    ) -> tuple[list[Any], bool]:
        with self.journal.connection() as db:
            where, params = "tenant = ?", [tenant]
            if after is not None:
                where += f" AND created_at < (SELECT created_at FROM {select.split()[-1]}"
                where += f" WHERE {key} = ?)"
                params.append(after)
            rows = db.execute(
                f"{select} WHERE {where} ORDER BY created_at DESC LIMIT ?", (*params, limit + 1)
            ).fetchall()
        items = [make(*row) for row in rows[:limit]]
        return items, len(rows) > limit


_BATCH_COLUMNS = (
    "batch_id, tenant, endpoint, input_file_id, completion_window, status, ending, "
    "metadata_json, total, completed, failed, output_file_id, error_file_id, created_at, "
    "expires_at, cancelling_at, finished_at"
)


def _line_counts(db: Any, batch_id: str) -> dict[str, int]:
    """Completed (answered 200) and failed lines of a batch still running."""
    completed, finished = db.execute(
        "SELECT COALESCE(SUM(state = 'done' AND json_extract(result_json, '$.status_code') = 200),"
        " 0), COALESCE(SUM(state IN ('done', 'failed')), 0) FROM jobs WHERE batch_id = ?",
        (batch_id,),
    ).fetchone()
    return {"completed": int(completed), "failed": int(finished) - int(completed)}
