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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from sluicegate.errors import APIError
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
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
#: OpenAI's limits: 50,000 requests per batch, 200 MB per file.
MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024
#: The one completion window OpenAI offers, in seconds.
COMPLETION_WINDOWS = {"24h": 86400.0}
_UNFINISHED = ("in_progress", "cancelling")


@dataclass(slots=True, frozen=True)
class FileRecord:
    file_id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float

    def view(self) -> dict[str, Any]:
        return {"id": self.file_id, "object": "file", "bytes": self.bytes,
                "created_at": int(self.created_at), "filename": self.filename,
                "purpose": self.purpose, "status": "processed"}  # fmt: skip


def check_batch_lines(data: bytes) -> int:
    """Check an uploaded batch file (JSONL of requests); returns its number of requests.
    Raises a 400 naming the first bad line."""
    seen: dict[str, int] = {}
    count = 0
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            raise _bad_file(f"it has more than {MAX_LINES} requests, the limit of one batch")
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _bad_file(f"line {number} is not JSON: {exc}") from None
        if not isinstance(line, dict):
            raise _bad_file(f"line {number} is not a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise _bad_file(f"line {number} has no custom_id (a non-empty string)")
        if custom_id in seen:
            raise _bad_file(f"line {number} repeats the custom_id of line {seen[custom_id]}")
        seen[custom_id] = number
        if line.get("method") != "POST":
            raise _bad_file(f"line {number}: method must be POST")
        if line.get("url") not in ENDPOINTS:
            raise _bad_file(f"line {number}: url must be one of {sorted(ENDPOINTS)}")
        if not isinstance(line.get("body"), dict):
            raise _bad_file(f"line {number}: body must be a JSON object")
    if count == 0:
        raise _bad_file("it has no requests")
    return count


def _bad_file(reason: str) -> APIError:
    return APIError(400, f"The batch file is not valid: {reason}.", param="file",
                    code="invalid_batch_file")  # fmt: skip


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
        files_dir.mkdir(parents=True, exist_ok=True)
        with journal.connection() as db:
            db.executescript(_SCHEMA)

    # ------------------------------------------------------------------ files
    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileRecord:
        if purpose != "batch":
            raise APIError(400, f"purpose must be 'batch'; got {purpose!r}", param="purpose")
        check_batch_lines(data)
        record = FileRecord(f"file-{uuid.uuid4().hex}", tenant, purpose, filename, len(data),
                            self._clock())  # fmt: skip
        self._write(record.file_id, [data])
        self._insert_file(record)
        return record

    def file(self, file_id: str, tenant: str) -> FileRecord:
        with self.journal.connection() as db:
            row = db.execute(
                "SELECT file_id, tenant, purpose, filename, bytes, created_at FROM files"
                " WHERE file_id = ?", (file_id,),
            ).fetchone()  # fmt: skip
        if row is None or row[1] != tenant:
            raise _not_found("file", file_id)
        return FileRecord(*row)

    def files(self, tenant: str, limit: int, after: str | None) -> tuple[list[FileRecord], bool]:
        """The tenant's files, newest first, ``limit`` after the file ``after``."""
        return self._page(
            "SELECT file_id, tenant, purpose, filename, bytes, created_at FROM files",
            "file_id", FileRecord, tenant, limit, after,
        )  # fmt: skip

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
        self, tenant: str, input_file_id: str, endpoint: str, completion_window: str,
        metadata: dict[str, str] | None,
    ) -> dict[str, Any]:  # fmt: skip
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {sorted(ENDPOINTS)}; got {endpoint!r}",
                           param="endpoint")  # fmt: skip
        window = COMPLETION_WINDOWS.get(completion_window)
        if window is None:
            raise APIError(400, f"completion_window must be '24h'; got {completion_window!r}",
                           param="completion_window")  # fmt: skip
        source = self.file(input_file_id, tenant)
        lines = []
        for raw in self.content(source).read_bytes().splitlines():
            if raw.strip():
                line = orjson.loads(raw)
                if line["url"] != endpoint:
                    raise APIError(
                        400, f"Request {line['custom_id']!r} is for {line['url']}, not the "
                        f"batch's endpoint {endpoint}.", param="endpoint",
                    )  # fmt: skip
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
                    (batch_id, tenant, endpoint, input_file_id, completion_window,
                     orjson.dumps(metadata).decode() if metadata else None, len(lines), now,
                     now + window),
                )  # fmt: skip
                db.executemany(
                    "INSERT INTO jobs (job_id, tenant, state, body_json, created_at, updated_at,"
                    " batch_id, custom_id, line) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
                    ((f"job-{uuid.uuid4().hex}", tenant,
                      orjson.dumps({"kind": kind, "body": line["body"]}).decode(), now, now,
                      batch_id, line["custom_id"], index) for index, line in enumerate(lines)),
                )  # fmt: skip
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return self.view(batch_id, tenant)

    def view(self, batch_id: str, tenant: str) -> dict[str, Any]:
        """The batch in OpenAI's shape, its counts as of now."""
        with self.journal.connection() as db:
            row = db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE batch_id = ?",
                             (batch_id,)).fetchone()  # fmt: skip
            if row is None or row[1] != tenant:
                raise _not_found("batch", batch_id)
            counts = _line_counts(db, batch_id) if row[5] in _UNFINISHED else None
        return _batch_view(row, counts)

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
        if view["status"] == "in_progress":
            with self.journal.connection() as db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("DELETE FROM jobs WHERE batch_id = ? AND state = 'queued'", (batch_id,))
                db.execute("UPDATE batches SET status = 'cancelling', ending = ?, cancelling_at = ?"
                           " WHERE batch_id = ?", (ending, self._clock(), batch_id))  # fmt: skip
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
        """Finalize the batch if none of its lines is queued or running any more."""
        with self.journal.connection() as db:
            row = db.execute("SELECT status, ending FROM batches WHERE batch_id = ?",
                             (batch_id,)).fetchone()  # fmt: skip
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
            ok, entry = _result_line(custom_id, job_id, state, result, error)
            outputs["output" if ok else "errors"].append(entry)
        now = self._clock()
        file_ids: dict[str, str | None] = {}
        for which, entries in outputs.items():
            if not entries:
                file_ids[which] = None
                continue
            file_id = f"file-{hex_id}-{which}"
            size = self._write(file_id, entries)
            self._insert_file(FileRecord(file_id, self._tenant(batch_id), "batch_output",
                                         f"{batch_id}_{which}.jsonl", size, now))  # fmt: skip
            file_ids[which] = file_id
        status = row[1] or "completed"
        with self.journal.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE batches SET status = ?, completed = ?, failed = ?, output_file_id = ?,"
                " error_file_id = ?, finished_at = ? WHERE batch_id = ?",
                (status, counts["completed"], counts["failed"], file_ids["output"],
                 file_ids["errors"], now, batch_id),
            )  # fmt: skip
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
                (record.file_id, record.tenant, record.purpose, record.filename, record.bytes,
                 record.created_at),
            )  # fmt: skip

    def _page(
        self, select: str, key: str, make: Any, tenant: str, limit: int, after: str | None
    ) -> tuple[list[Any], bool]:
        with self.journal.connection() as db:
            where, params = "tenant = ?", [tenant]
            if after is not None:
                where += f" AND created_at < (SELECT created_at FROM {select.split()[-1]}"
                where += f" WHERE {key} = ?)"
                params.append(after)
            rows = db.execute(f"{select} WHERE {where} ORDER BY created_at DESC LIMIT ?",
                              (*params, limit + 1)).fetchall()  # fmt: skip
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


def _result_line(
    custom_id: str, job_id: str, state: str, result: str | None, error: str | None
) -> tuple[bool, bytes]:
    """A line of the output file (True) or of the error file (False), newline included."""
    line_id = "batch_req_" + job_id.removeprefix("job-")
    if state == "done" and result is not None:
        answer = orjson.loads(result)
        body = answer["body"]
        ok = answer["status_code"] == 200
        response = {"status_code": answer["status_code"],
                    "request_id": body.get("id") if ok else None, "body": body}  # fmt: skip
        entry = {"id": line_id, "custom_id": custom_id, "response": response, "error": None}
    else:
        ok = False
        entry = {"id": line_id, "custom_id": custom_id, "response": None,
                 "error": {"code": "failed", "message": error or "the request failed"}}  # fmt: skip
    return ok, orjson.dumps(entry) + b"\n"


def _batch_view(row: tuple[Any, ...], counts: dict[str, int] | None) -> dict[str, Any]:
    (batch_id, _tenant, endpoint, input_file_id, window, status, _ending, metadata, total,
     completed, failed, output_file_id, error_file_id, created_at, expires_at, cancelling_at,
     finished_at) = row  # fmt: skip
    if counts is not None:
        completed, failed = counts["completed"], counts["failed"]

    def stamp(value: float | None) -> int | None:
        return None if value is None else int(value)

    finished = stamp(finished_at)
    return {
        "id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
        "input_file_id": input_file_id, "completion_window": window, "status": status,
        "output_file_id": output_file_id, "error_file_id": error_file_id,
        "created_at": int(created_at), "in_progress_at": int(created_at),
        "expires_at": int(expires_at), "finalizing_at": finished,
        "completed_at": finished if status == "completed" else None, "failed_at": None,
        "expired_at": finished if status == "expired" else None,
        "cancelling_at": stamp(cancelling_at),
        "cancelled_at": finished if status == "cancelled" else None,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": orjson.loads(metadata) if metadata else None,
    }  # fmt: skip
