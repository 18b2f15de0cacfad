"""The Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` (poll, or resume
its stream with ``?stream=true&starting_after=N``), ``POST /v1/responses/{id}/cancel``,
``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A response is generated as a chat completion (:mod:`sluicegate.api.responses_input`)
through the same front door, admission, queue and flow control, embedded or in front of
an upstream's chat completions.  A streamed or background response is a resumable stream
whose events are the Responses API's (:mod:`sluicegate.stream.response_events`): its
replay log *is* the stored response, so any replica shows it, resumes it from a
``sequence_number``, and continues it when the replica that generated it is gone.  A
non-streamed response with ``store`` (the default) is logged whole when it ends.  Stored
responses last ``replay_ttl_seconds`` after their last event, like every stream's log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.tenants import Tenant
from sluicegate.api.access import not_found, owner_admits, presented_resume_token
from sluicegate.api.body import parse_json, read_body
from sluicegate.api.openai_routes import disconnected
from sluicegate.api.pipelines import submit_prepared
from sluicegate.api.prepare import Prepared, prepare, response_body, stream_format
from sluicegate.api.responses_background import journal_background
from sluicegate.api.responses_input import (
    ResponsesRequest,
    as_responses_error,
    chat_body,
    chat_messages,
    input_items,
    output_items_as_input,
    parse_request,
    template,
)
from sluicegate.api.resume import expired_error, resume, store_down_error, stream_position
from sluicegate.api.state import Ready, app_state, ready_state
from sluicegate.api.stats import json_response
from sluicegate.errors import APIError, invalid_param
from sluicegate.service.collect import collect
from sluicegate.service.generation import new_request_id
from sluicegate.service.ownership import RESUME_TOKEN_HEADER, Owner
from sluicegate.service.service import Service
from sluicegate.store.errors import (
    ReplayTrimmed,
    StoreUnavailable,
    StreamExpired,
    StreamNotFound,
)
from sluicegate.store.event_id import validate_stream_id
from sluicegate.stream.events import StreamFormat
from sluicegate.stream.log_reads import read_all
from sluicegate.stream.response_events import (
    ResponseEvents,
    drop_through,
    last_sequence_number,
)
from sluicegate.stream.sessions import CANCEL_ASKED
from sluicegate.stream.sse import DONE

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: HTTPRequest) -> Response:
    arrival = time.monotonic()
    state = app_state(request)
    ready = state.require_ready()
    service = ready.service
    tenant = service.authenticate(request.headers.get("authorization"))
    await service.charge_request(tenant)
    raw = await read_body(request, service.settings.max_request_body_bytes)
    body = parse_json(raw)
    req = parse_request(body)
    previous: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        token = presented_resume_token(request)
        previous = await _conversation(ready, tenant, token, req.previous_response_id)
    items = input_items(req)
    conversation = previous + items
    prepared, dropped = await state.body_workers.run(
        len(raw), lambda: _prepare(service, req, body, conversation)
    )
    prepared.request_id = new_request_id("resp")
    fixed = template(prepared.request_id, prepared.model, req, req.tools)
    if dropped:
        # truncation "auto" dropped the oldest items to fit the context: said here.
        fixed["sluicegate"] = {"truncated_input_items": dropped}
    details = {"template": fixed, "conversation": conversation, "input_count": len(items)}
    if req.background:
        return await _background(ready, tenant, prepared, details, bool(req.stream))
    generation = await submit_prepared(service, tenant, prepared, arrival)
    fmt = dataclasses.replace(
        stream_format(service, prepared, generation.created, generation.priority_label),
        include_usage=True,
        continuous_usage=False,
        response=details,
    )
    headers = dict(generation.headers)
    if req.stream:
        session = await ready.sessions.open(generation, tenant, fmt)
        return session.response(0, headers)
    output, answer = await collect(service, generation, disconnected(request))
    chat = response_body(service, prepared, generation, output, answer)
    events, data = _events_of(fixed, chat)
    if fixed["store"]:
        await ready.sessions.log_finished(generation, tenant, fmt, data + DONE)
        if generation.resume_token is not None:  # open mode: what retrieving it needs
            headers[RESUME_TOKEN_HEADER] = generation.resume_token
    return json_response(events.response(), headers=headers)


async def _background(
    ready: Ready, tenant: Tenant, prepared: Prepared, details: dict[str, Any], stream: bool
) -> Response:
    """A background response journaled (:mod:`sluicegate.api.responses_background`); its
    stream served from its start when asked for (taken over here at once)."""
    service = ready.service
    priority = prepared.req.priority or tenant.priority_class.value
    fmt = dataclasses.replace(
        stream_format(service, prepared, int(time.time()), priority),
        include_usage=True,
        continuous_usage=False,
        response=details,
    )
    try:
        events, token = await journal_background(ready.sessions, ready.jobs, tenant, prepared, fmt)
    except StoreUnavailable as error:
        raise store_down_error(error) from None
    headers = {"x-request-id": prepared.request_id, RESUME_TOKEN_HEADER: token}
    if stream:
        return await resume(ready, tenant, token, prepared.request_id, 0, None, headers)
    return json_response(events.response(), headers=headers)


def _prepare(
    service: Service,
    req: ResponsesRequest,
    raw: dict[str, Any],
    conversation: list[dict[str, Any]],
) -> tuple[Prepared, int]:
    """The chat request a response is generated as; with ``truncation: "auto"``, the
    oldest items dropped until it fits the context (returns how many were)."""
    dropped = 0
    while True:
        body = chat_body(req, chat_messages(conversation[dropped:]), raw)
        try:
            return prepare(service, "chat", body), dropped
        except APIError as error:
            fits = error.code != "context_length_exceeded"
            if fits or req.truncation != "auto" or dropped + 1 >= len(conversation):
                raise as_responses_error(error) from None
            dropped += 1
            # A call's output makes no sense without its call: they go together.
            while dropped < len(conversation) - 1 and conversation[dropped].get("type") in (
                "function_call_output",
            ):
                dropped += 1


def _events_of(fixed: dict[str, Any], chat: dict[str, Any]) -> tuple[ResponseEvents, bytes]:
    """A whole chat completion as a response's events (a non-streamed response)."""
    events = ResponseEvents(fixed)
    data = events.opening()
    choice = chat["choices"][0]
    message = choice["message"]
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
    delta = {"content": message.get("content"), "tool_calls": calls}
    data += events.encode({"choices": [{"delta": delta}]})
    ending = {"choices": [{"finish_reason": choice["finish_reason"]}], "usage": chat["usage"]}
    data += events.finish([ending])
    return events, data


# --- stored responses ---


@dataclasses.dataclass(slots=True)
class Stored:
    """A stored response as its log shows it."""

    response_id: str
    fmt: StreamFormat
    events: ResponseEvents
    owner: Owner
    #: (log seq, highest sequence number in it) of each logged entry.
    entries: list[tuple[int, int | None]]

    @property
    def details(self) -> dict[str, Any]:
        assert self.fmt.response is not None
        return self.fmt.response


async def _stored(
    ready: Ready, tenant: Tenant, token: str | None, response_id: str, *, unstored: bool = False
) -> Stored:
    """A response by id, for its owner (a 404 for anyone else, and for a response made
    with ``store: false`` unless ``unstored``)."""
    missing = _not_found(ready, response_id)
    try:
        validate_stream_id(response_id)
    except ValueError:
        raise missing from None
    store = ready.store
    try:
        meta = await store.get_meta(response_id)
        owner = Owner(meta.tenant, meta.resume_token_sha256)
        fmt = StreamFormat.from_json(meta.extra, meta.model)
        if fmt.response is None or not owner_admits(ready, owner, tenant.name, token):
            raise missing
        if not fmt.response["template"].get("store") and not unstored:
            raise missing
        data = await read_all(store, response_id)
    except (StreamNotFound, ReplayTrimmed):
        raise missing from None
    except StreamExpired:
        raise expired_error(response_id) from None
    except StoreUnavailable as error:
        raise store_down_error(error) from None
    events = ResponseEvents.restore(fmt.response["template"], data)
    entries = [(seq, last_sequence_number(entry)) for seq, entry in enumerate(data, start=1)]
    return Stored(response_id, fmt, events, owner, entries)


async def _conversation(
    ready: Ready, tenant: Tenant, token: str | None, response_id: str
) -> list[dict[str, Any]]:
    """What a continuation of ``response_id`` starts from: its conversation and output."""
    try:
        stored = await _stored(ready, tenant, token, response_id)
    except APIError as error:
        error.param = "previous_response_id"
        raise
    if not stored.events.finished:
        raise invalid_param(
            "previous_response_id",
            f"Response '{response_id}' is still {stored.events.status}; continue it once it "
            "has finished.",
        )
    previous = list(stored.details.get("conversation") or [])
    return previous + output_items_as_input(stored.events.output)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: HTTPRequest) -> Response:
    ready = ready_state(request)
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    token = presented_resume_token(request)
    if request.query_params.get("stream", "false").lower() == "true":
        return await _resume_events(ready, tenant, token, response_id, request)
    local = ready.sessions.get(response_id)
    if (
        local is not None
        and local.responses is not None
        and not local.done
        and owner_admits(ready, local.generation.owner, tenant.name, token)
        and local.responses.template.get("store")
    ):
        return json_response(local.responses.response())
    stored = await _stored(ready, tenant, token, response_id)
    background = stored.events.template.get("background")
    if background and not stored.events.finished and local is None:
        # Nobody generates it here (its replica drained or died): it goes on here.
        session = await _take_over(ready, tenant, response_id)
        if session is not None and session.responses is not None:
            return json_response(session.responses.response())
    return json_response(stored.events.response())


async def _take_over(ready: Ready, tenant: Tenant, response_id: str) -> Any:
    if ready.service.admission.draining:
        return None
    try:
        if await ready.store.lease_owner(response_id) is not None:
            return None
        return await ready.sessions.take_over(tenant, response_id)
    except StreamExpired:
        raise expired_error(response_id) from None
    except StoreUnavailable as error:
        raise store_down_error(error) from None


async def _resume_events(
    ready: Ready, tenant: Tenant, token: str | None, response_id: str, request: HTTPRequest
) -> Response:
    """The stream again: after ``starting_after`` (a sequence number, exclusive), else
    after ``Last-Event-ID``, else from its start."""
    cursor = request.query_params.get("starting_after")
    if cursor is None:
        after_seq = stream_position(ready, response_id, request)
        return await resume(ready, tenant, token, response_id, after_seq)
    try:
        starting_after = int(cursor)
        if starting_after < -1:
            raise ValueError
    except ValueError:
        raise invalid_param(
            "starting_after", f"starting_after is a sequence number (>= -1); got {cursor!r}"
        ) from None
    stored = await _stored(ready, tenant, token, response_id, unstored=True)
    after_seq = 0
    for seq, highest in stored.entries:
        if highest is not None and highest <= starting_after:
            after_seq = seq
    if stored.events.finished and starting_after >= stored.events.next_sequence:
        raise APIError(
            400,
            f"Response '{response_id}' has events 0 to {stored.events.next_sequence - 1}; "
            f"starting_after={starting_after} is past its end.",
            param="starting_after",
            code="invalid_position",
        )

    async def after(events: AsyncIterator[tuple[bytes, int]]) -> AsyncIterator[tuple[bytes, int]]:
        passing = False
        async for data, tokens in events:
            if not passing:
                highest = last_sequence_number(data)
                if highest is not None:
                    passing = True
                    data = drop_through(data, starting_after)
                    if not data:
                        continue
            yield data, tokens

    return await resume(ready, tenant, token, response_id, after_seq, after)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: HTTPRequest) -> Response:
    """Stop a response being generated; it ends ``cancelled`` with what it has.  On a
    replica that does not generate it, the one that does is asked through the store
    (and answers within a lease renewal).  A response that ended otherwise cannot be
    cancelled (409)."""
    ready = ready_state(request)
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    token = presented_resume_token(request)
    local = ready.sessions.get(response_id)
    if local is not None and local.responses is not None and not local.done:
        if not owner_admits(ready, local.generation.owner, tenant.name, token):
            raise _not_found(ready, response_id)
        ready.service.cancel(local.generation)
        await local.wait_done()
        return json_response(local.responses.response())
    stored = await _stored(ready, tenant, token, response_id, unstored=True)
    if stored.events.status == "cancelled":
        return json_response(stored.events.response())
    if stored.events.finished:
        raise APIError(
            409,
            f"Response '{response_id}' has already ended ({stored.events.status}); only a "
            "response still being generated can be cancelled.",
            param="response_id",
            code="response_not_cancellable",
        )
    # Nobody generates it here: end its log if nobody generates it, else ask its replica.
    store = ready.store
    owner = ready.sessions.owner
    try:
        if await store.acquire_lease(response_id, owner, ready.sessions.lease_ttl_seconds):
            try:
                end = stored.events.finish([], cancelled=True)
                await store.append(response_id, end + DONE, owner=owner)
                await store.finish(response_id, owner=owner)
            finally:
                await store.release_lease(response_id, owner)
            return json_response(stored.events.response())
        meta = await store.get_meta(response_id)
        await store.update_meta(response_id, extra={**meta.extra, CANCEL_ASKED: True})
    except StoreUnavailable as error:
        raise store_down_error(error) from None
    # The generating replica sees the mark at its next lease renewal (a third of the TTL).
    deadline = time.monotonic() + ready.sessions.lease_ttl_seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        stored = await _stored(ready, tenant, token, response_id, unstored=True)
        if stored.events.finished:
            break
    return json_response(stored.events.response())


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: HTTPRequest) -> Response:
    """Forget a stored response (one being generated is cancelled first)."""
    ready = ready_state(request)
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    token = presented_resume_token(request)
    local = ready.sessions.get(response_id)
    if local is not None and local.responses is not None:
        if not owner_admits(ready, local.generation.owner, tenant.name, token):
            raise _not_found(ready, response_id)
        ready.service.cancel(local.generation)
        await local.wait_done()
    await _stored(ready, tenant, token, response_id, unstored=True)
    try:
        await ready.store.delete(response_id)
    except StoreUnavailable as error:
        raise store_down_error(error) from None
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: HTTPRequest) -> Response:
    """The items of the request that made the response (``order``, ``limit``, ``after``)."""
    ready = ready_state(request)
    tenant = ready.service.authenticate(request.headers.get("authorization"))
    stored = await _stored(ready, tenant, presented_resume_token(request), response_id)
    conversation = list(stored.details.get("conversation") or [])
    count = int(stored.details.get("input_count") or 0)
    items = [
        _shown_item(f"{response_id}-item-{i}", item)
        for i, item in enumerate(conversation[len(conversation) - count :])
    ]
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_param("order", f"order is 'asc' or 'desc'; got {order!r}")
    try:
        limit = int(params.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid_param("limit", f"limit is between 1 and 100; got {params.get('limit')!r}")
    if order == "desc":
        items.reverse()
    after = params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid_param("after", f"no input item '{after[:100]}' in this response")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def _shown_item(item_id: str, item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the API lists it (a message's text as a content part)."""
    shown = {"id": item_id, **item}
    if item.get("type") == "message":
        kind = "output_text" if item.get("role") == "assistant" else "input_text"
        shown["content"] = [{"type": kind, "text": item.get("content") or ""}]
        shown["status"] = "completed"
    return shown


def _not_found(ready: Ready, response_id: str) -> APIError:
    open_mode = not ready.service.tenants.auth_enabled
    return not_found("response", "response_id", response_id, open_mode=open_mode)
