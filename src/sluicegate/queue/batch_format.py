"""What the Batch API's files and objects look like: an uploaded batch file checked line
by line, file records, and result lines and batch objects in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson

from sluicegate.errors import APIError

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
#: OpenAI's limits: 50,000 requests per batch, 200 MB per file.
MAX_LINES = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024
#: The one completion window OpenAI offers, in seconds.


@dataclass(slots=True, frozen=True)
class FileRecord:
    file_id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float

    def view(self) -> dict[str, Any]:
        return {
            "id": self.file_id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


def check_batch_lines(data: bytes) -> int:
    """Check an uploaded batch file (JSONL of requests); returns its number of requests.
    Raises a 400 naming the first bad line."""
    checker = LineChecker()
    for raw in data.splitlines():
        checker.feed(raw)
    return checker.finish()


#: Checks one line's request as the server would run it (``url``, ``body``): raises the
#: :class:`APIError` its request would get (a prompt over the context, a bad parameter).
LineValidator = Callable[[str, dict[str, Any]], None]


class LineChecker:
    """The lines of a batch file checked one at a time, as an upload streams in (each
    line's request too, with ``validate``)."""

    def __init__(self, validate: LineValidator | None = None) -> None:
        self.validate = validate
        self.seen: dict[str, int] = {}
        self.count = 0
        self.number = 0

    def feed(self, raw: bytes) -> None:
        """Check the next line (its newline stripped); a 400 naming it when it is bad."""
        self.number += 1
        number = self.number
        if not raw.strip():
            return
        self.count += 1
        if self.count > MAX_LINES:
            raise bad_file(f"it has more than {MAX_LINES} requests, the limit of one batch")
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad_file(f"line {number} is not JSON: {exc}") from None
        if not isinstance(line, dict):
            raise bad_file(f"line {number} is not a JSON object")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise bad_file(f"line {number} has no custom_id (a non-empty string)")
        if custom_id in self.seen:
            raise bad_file(f"line {number} repeats the custom_id of line {self.seen[custom_id]}")
        self.seen[custom_id] = number
        if line.get("method") != "POST":
            raise bad_file(f"line {number}: method must be POST")
        if line.get("url") not in ENDPOINTS:
            raise bad_file(f"line {number}: url must be one of {sorted(ENDPOINTS)}")
        if not isinstance(line.get("body"), dict):
            raise bad_file(f"line {number}: body must be a JSON object")
        if self.validate is not None:
            try:
                self.validate(line["url"], line["body"])
            except APIError as error:
                raise bad_file(f"line {number} ({custom_id[:64]}): {error.message}") from None

    def finish(self) -> int:
        if self.count == 0:
            raise bad_file("it has no requests")
        return self.count


def bad_file(reason: str) -> APIError:
    return APIError(
        400, f"The batch file is not valid: {reason}.", param="file", code="invalid_batch_file"
    )


def result_line(
    custom_id: str, job_id: str, state: str, result: str | None, error: str | None
) -> tuple[bool, bytes]:
    """A line of the output file (True) or of the error file (False), newline included."""
    line_id = "batch_req_" + job_id.removeprefix("job-")
    if state == "done" and result is not None:
        answer = orjson.loads(result)
        body = answer["body"]
        ok = answer["status_code"] == 200
        response = {
            "status_code": answer["status_code"],
            "request_id": body.get("id") if ok else None,
            "body": body,
        }
        entry = {"id": line_id, "custom_id": custom_id, "response": response, "error": None}
    else:
        ok = False
        entry = {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": "failed", "message": error or "the request failed"},
        }
    return ok, orjson.dumps(entry) + b"\n"


def batch_view(row: tuple[Any, ...], counts: dict[str, int] | None) -> dict[str, Any]:
    (
        batch_id,
        _tenant,
        endpoint,
        input_file_id,
        window,
        status,
        _ending,
        metadata,
        total,
        completed,
        failed,
        output_file_id,
        error_file_id,
        created_at,
        expires_at,
        cancelling_at,
        finished_at,
    ) = row
    if counts is not None:
        completed, failed = counts["completed"], counts["failed"]

    def stamp(value: float | None) -> int | None:
        return None if value is None else int(value)

    finished = stamp(finished_at)
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": status,
        "output_file_id": output_file_id,
        "error_file_id": error_file_id,
        "created_at": int(created_at),
        "in_progress_at": int(created_at),
        "expires_at": int(expires_at),
        "finalizing_at": finished,
        "completed_at": finished if status == "completed" else None,
        "failed_at": None,
        "expired_at": finished if status == "expired" else None,
        "cancelling_at": stamp(cancelling_at),
        "cancelled_at": finished if status == "cancelled" else None,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": orjson.loads(metadata) if metadata else None,
    }


def copy_checked(
    source: BinaryIO,
    out: BinaryIO,
    max_line_bytes: int,
    check: Callable[[int], None],
    validate: LineValidator | None = None,
) -> int:
    """Copy an upload from ``source`` to ``out`` a megabyte at a time, each line checked
    as it comes (memory holds a chunk and one line; ``validate``: its request too),
    ``check`` given the bytes so far after each chunk; the bytes copied."""
    checker, partial, size = LineChecker(validate), b"", 0
    while chunk := source.read(1 << 20):
        size += len(chunk)
        check(size)
        out.write(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in [*lines, partial]:
            if len(line) > max_line_bytes:
                raise _line_too_large(checker.number + 1, max_line_bytes)
            if line is not partial:
                checker.feed(line.removesuffix(b"\r"))
    checker.feed(partial.removesuffix(b"\r"))
    checker.finish()
    return size


def check_size(size: int, used: int, quota_bytes: int) -> None:
    """A 413 for a file past ``MAX_FILE_BYTES`` or past what its tenant may store."""
    if size > MAX_FILE_BYTES:
        raise APIError(413, f"Files are limited to {MAX_FILE_BYTES} bytes.", code="file_too_large")
    if used + size > quota_bytes:
        raise APIError(
            413,
            f"The file would take this tenant's stored files to over {quota_bytes} bytes "
            f"({used} stored): delete files it no longer needs (DELETE /v1/files/{{id}}).",
            code="storage_quota_exceeded",
        )


def _line_too_large(number: int, max_line_bytes: int) -> APIError:
    return APIError(
        413,
        f"Line {number} of the batch file is over {max_line_bytes} bytes, the largest "
        "request body this server takes.",
        param="file",
        code="line_too_large",
    )
