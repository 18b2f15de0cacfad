"""``GET /v1/streams/{stream_id}``: resume a stream after a dropped connection.

The client says what it has with ``Last-Event-ID: <stream-id>:<seq>`` (what an
``EventSource`` sends by itself) or ``?after=<seq>``; with neither, the stream is replayed
from its start.  It gets the events after that position, then the live ones:

* the stream is still generated here: the connection attaches to it;
* it is finished: its log is replayed to the end;
* nobody generates it (its replica drained, gave it up after the detach grace, or died
  and its lease expired): this replica takes it over and continues it exactly;
* another replica generates it: the log is followed live, and taken over as soon as the
  other replica lets go (or its lease expires).

Only the stream's owner can resume it: the tenant that created it or, in open mode, the
holder of its resume token (``x-sluicegate-resume-token``, returned only to its creator;
see :mod:`sluicegate.api.access`).  For anyone else it does not exist (404, never 403).
A stream whose log expired is 410.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.tenants import Tenant
from sluicegate.api.access import not_found as _no_such
from sluicegate.api.access import owner_admits, presented_resume_token
from sluicegate.api.state import Ready, ready_state
from sluicegate.errors import APIError
from sluicegate.service.ownership import Owner
from sluicegate.store.errors import (
    InvalidReplayPosition,
    ReplayTrimmed,
    StoreUnavailable,
    StreamExpired,
    StreamNotFound,
)
from sluicegate.store.event_id import parse_after_seq, parse_event_id, validate_stream_id
from sluicegate.stream.log_reads import REPLAY_BATCH_EVENTS, Transform
from sluicegate.stream.replay import follow, replay
from sluicegate.stream.session import StreamSession
from sluicegate.stream.sse import EventStreamResponse, SSEConnection

logger = logging.getLogger(__name__)
router = APIRouter()

#: How a resume was served (the ``stream_resumes_total{status}`` label values).
RESUME_STATUSES = ("attach", "replay", "follow", "takeover", "rejected", "not_found")


@router.get("/v1/streams/{stream_id}")
async def resume_stream(stream_id: str, request: HTTPRequest) -> Response:
    ready = ready_state(request)
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    token = presented_resume_token(request)
    try:
        after_seq = stream_position(ready, stream_id, request)
        return await resume(ready, tenant, token, stream_id, after_seq)
    except APIError as error:
        status = "rejected" if error.status_code != 404 else "not_found"
        ready.service.metrics.stream_resumes_total.labels(status).inc()
        raise


async def resume(
    ready: Ready,
    tenant: Tenant,
    token: str | None,
    stream_id: str,
    after_seq: int,
    transform: Transform | None = None,
    extra_headers: dict[str, str] | None = None,
) -> Response:
    """Serve a stream from ``after_seq``: attached, replayed, followed or taken over
    (``transform``: what its events pass through, see :meth:`StreamSession.response`)."""
    store = ready.store
    metrics = ready.service.metrics
    headers = {"x-sluicegate-stream-id": stream_id, "x-request-id": stream_id}
    headers.update(extra_headers or {})
    local = ready.sessions.get(stream_id)
    if local is not None and not owner_admits(ready, local.generation.owner, tenant.name, token):
        raise _not_found(ready, stream_id)
    if local is not None and local.stop_reason is not None:
        # Stopping (detach grace over, drain, lease lost): once it has checkpointed, the
        # stream is served from the store like any other.
        await local.wait_done()
        local = None
    if local is not None and not local.done:
        if after_seq > local.last_seq:
            raise _bad_position(InvalidReplayPosition(stream_id, after_seq, local.last_seq))
        metrics.stream_resumes_total.labels("attach").inc()
        return local.response(after_seq, headers, transform)
    try:
        meta = await store.get_meta(stream_id)
        if not owner_admits(
            ready, Owner(meta.tenant, meta.resume_token_sha256), tenant.name, token
        ):
            raise _not_found(ready, stream_id)
        head = await store.read(stream_id, after_seq, limit=REPLAY_BATCH_EVENTS)
    except StreamExpired:
        raise expired_error(stream_id) from None
    except StreamNotFound:
        raise _not_found(ready, stream_id) from None
    except InvalidReplayPosition as error:
        raise _bad_position(error) from None
    except StoreUnavailable as error:
        raise store_down_error(error) from None
    if head.trimmed:
        raise _trimmed(ReplayTrimmed(stream_id, after_seq, head.resumable_from_seq))
    connection = SSEConnection()
    if head.finished:
        metrics.stream_resumes_total.labels("replay").inc()
        events = replay(store, stream_id, after_seq, head, connection)
        return _response(ready, events, connection, headers, transform)
    if ready.service.admission.draining:
        raise APIError(
            503,
            "The server is shutting down; resume the stream on another replica.",
            code="server_draining",
            headers={"retry-after": "1"},
        )
    session = await _try_take_over(ready, tenant, stream_id)
    if session is not None:
        metrics.stream_resumes_total.labels("takeover").inc()
        return session.response(after_seq, headers, transform)
    metrics.stream_resumes_total.labels("follow").inc()
    events = follow(ready.sessions, tenant, stream_id, after_seq, connection)
    return _response(ready, events, connection, headers, transform)


async def _try_take_over(ready: Ready, tenant: Tenant, stream_id: str) -> StreamSession | None:
    try:
        return await ready.sessions.take_over(tenant, stream_id)
    except StreamExpired:
        raise expired_error(stream_id) from None
    except StoreUnavailable as error:
        raise store_down_error(error) from None


def _response(
    ready: Ready,
    events: AsyncIterator[tuple[bytes, int]],
    connection: SSEConnection,
    headers: dict[str, str],
    transform: Transform | None,
) -> EventStreamResponse:
    return EventStreamResponse(
        events if transform is None else transform(events),
        connection,
        headers=headers,
        on_send_blocked=ready.service.metrics.stream_send_blocked_seconds.observe,
    )


def stream_position(ready: Ready, stream_id: str, request: HTTPRequest) -> int:
    """The client's position: ``Last-Event-ID`` (it wins: it is newer), ``?after``, or 0."""
    try:
        validate_stream_id(stream_id)
    except ValueError:
        raise _not_found(ready, stream_id) from None
    last_event_id = request.headers.get("last-event-id")
    if last_event_id:
        try:
            event_stream, seq = parse_event_id(last_event_id)
        except ValueError as error:
            raise APIError(400, str(error), param="Last-Event-ID") from None
        if event_stream != stream_id:
            raise APIError(
                400,
                f"Last-Event-ID names stream '{event_stream}', not '{stream_id}'.",
                param="Last-Event-ID",
            )
        return seq
    after = request.query_params.get("after")
    if after is None:
        return 0
    try:
        return parse_after_seq(after)
    except ValueError as error:
        raise APIError(400, str(error), param="after") from None


def _not_found(ready: Ready, stream_id: str) -> APIError:
    open_mode = not ready.service.tenants.auth_enabled
    return _no_such("stream", "stream_id", stream_id, open_mode=open_mode)


def expired_error(stream_id: str) -> APIError:
    return APIError(
        410,
        f"Stream '{stream_id}' has expired: its replay log is dropped replay_ttl_seconds "
        "after its last event, so it can no longer be resumed. Send the request again.",
        param="stream_id",
        code="stream_expired",
    )


def _trimmed(error: ReplayTrimmed) -> APIError:
    return APIError(
        410,
        f"{error}. Resume with Last-Event-ID {error.stream_id}:{error.resumable_from_seq} or "
        "later, or send the request again.",
        param="Last-Event-ID",
        code="replay_trimmed",
    )


def _bad_position(error: InvalidReplayPosition) -> APIError:
    return APIError(400, str(error), param="Last-Event-ID", code="invalid_position")


def store_down_error(error: StoreUnavailable) -> APIError:
    return APIError(
        503,
        f"The replay store is unreachable: {error}. Retry shortly.",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )
