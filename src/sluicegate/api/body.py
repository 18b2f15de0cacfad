"""A request body: read under its limits, then parsed, off the event loop when it is large.

Reading checks the media type (415), the size (413, before a byte is read when the
``Content-Length`` says so) and survives a client that leaves half-way (one log line,
no traceback).  Parsing and preparing a body (JSON, validation, the chat template,
tokenisation) is cheap for ordinary requests and is done inline; a body larger than
:data:`INLINE_MAX_BYTES` is handed to a small pool of worker threads, so that a
megabyte prompt costs the event loop nothing (tokenisation releases the GIL, see
:meth:`sluicegate.engine.tokenizer.TextTokenizer.encode`) and ``/health`` stays fast
while a few clients send huge prompts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from sluicegate.errors import APIError

logger = logging.getLogger("sluicegate")

T = TypeVar("T")

#: Bodies up to this size are parsed on the event loop (a thread hop would cost more).
INLINE_MAX_BYTES = 64 * 1024
#: Threads that parse and tokenise large bodies: few, so huge prompts queue for them
#: rather than take every core from the engine.
PARSE_WORKERS = 2


def check_content_type(content_type: str | None) -> None:
    """JSON or nothing: a form or a file upload is a 415 that says what to send."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in ("", "application/json") or media_type.endswith("+json"):
        return
    raise APIError(
        415,
        f"Content-Type {media_type!r} is not supported: send the body as JSON with "
        "'Content-Type: application/json' (with curl: -H 'content-type: application/json').",
        code="unsupported_media_type",
    )


async def read_body(request: HTTPRequest, max_bytes: int) -> bytes:
    """The whole body; 413 past ``max_bytes``, 415 for a media type that is not JSON."""
    check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"Request body is {declared} bytes; the limit is {max_bytes} bytes.")
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > max_bytes:
                raise APIError(413, f"Request body exceeds the limit of {max_bytes} bytes.")
    except ClientDisconnect:
        logger.info(
            "client %s left while sending its body (%d of %s bytes received)",
            _client(request),
            len(body),
            declared or "?",
        )
        raise APIError(499, "The client disconnected before sending its whole body.") from None
    if not body:
        raise APIError(400, "The request body is empty; send a JSON object.")
    return bytes(body)


def parse_json(body: bytes | str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}.") from None


class BodyWorkers:
    """Runs the parsing of large bodies on a few threads; small ones run inline."""

    def __init__(self, max_workers: int = PARSE_WORKERS) -> None:
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sluicegate-parse")

    async def run(self, size_bytes: int, work: Callable[[], T]) -> T:
        """``work()``, inline for a small body, else on a worker thread."""
        if size_bytes <= INLINE_MAX_BYTES:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _client(request: HTTPRequest) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client is not None else "?"
