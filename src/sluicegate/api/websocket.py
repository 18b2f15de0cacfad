"""WebSocket transport with credit-based flow control, at ``/v1/ws``.

Protocol (JSON text frames):

* client → server, first: ``{"type": "request", "body": {...chat completion body...},
  "credits": N}`` (``credits`` optional: omitted means unlimited).  The API key comes in
  the ``Authorization`` header, or in ``body``-less form as ``"api_key"`` in this message
  for browsers, which cannot set WebSocket headers.
* client → server, any time: ``{"type": "credit", "tokens": N}`` allows N more tokens;
  ``{"type": "cancel"}`` aborts the generation.
* server → client: ``chat.completion.chunk`` objects exactly as in SSE (the same
  :class:`~sluicegate.stream.writer.ChunkWriter` makes them: the role, the text, the
  finish reason and, with ``stream_options.include_usage``, the usage chunk), then
  ``{"type": "done", "finish_reason": ..., "usage": {...}}`` and a normal close (1000).
  Errors: ``{"type": "error", "error": {...OpenAI error...}}`` then close 1008 (auth),
  1013 (try again later: rate limits, full queue), or 1003 (bad request).  A message the
  server cannot take, first or later (not JSON, binary, an unknown ``type``, credits that
  are not a positive integer), is a bad request: error frame, close 1003, and the
  generation is cancelled.

The server sends at most the credited tokens.  A sequence whose buffered tokens already
use up its credit is paused exactly like a full socket buffer: it costs the batch
nothing, and its KV cache is freed if the pause lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, TypeGuard

import orjson
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from sluicegate.api.pipelines import submit_prepared
from sluicegate.api.prepare import prepare, stream_format
from sluicegate.api.state import Ready, app_state, ready_state
from sluicegate.errors import APIError
from sluicegate.service.generation import Generation, finish_reason_text
from sluicegate.stream.events import StreamFormat, usage
from sluicegate.stream.flow import FlowController, StreamFlow
from sluicegate.stream.writer import ChunkWriter

router = APIRouter()

CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED = 1003
CLOSE_POLICY = 1008
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN = 1013


def _close_code(error: APIError) -> int:
    if error.status_code == 401:
        return CLOSE_POLICY
    if error.status_code in (429, 503):
        return CLOSE_TRY_AGAIN
    if error.status_code >= 500:
        return CLOSE_INTERNAL
    return CLOSE_UNSUPPORTED


async def _send_error(websocket: WebSocket, error: APIError) -> None:
    body = error.body()
    body["type"] = "error"
    if "retry-after" in error.headers:
        body["retry_after_seconds"] = int(error.headers["retry-after"])
    await websocket.send_text(orjson.dumps(body).decode())
    await websocket.close(_close_code(error), error.message[:120])


async def _receive_message(websocket: WebSocket) -> tuple[dict[str, Any], int]:
    """The next message as a JSON object, and its size; a bad one raises a 400 (1003).
    Raises ``WebSocketDisconnect`` when the client has gone."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise APIError(400, "Messages must be JSON text frames, not binary.")
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"The message is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise APIError(400, "Each message must be a JSON object with a 'type'.", param="type")
    return data, len(text)


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@router.websocket("/v1/ws")
async def chat_websocket(websocket: WebSocket) -> None:
    await websocket.accept()
    try:
        first, size = await _receive_message(websocket)
        ready = ready_state(websocket)
        generation, flow, fmt = await _start(ready, websocket, first, size)
    except WebSocketDisconnect:
        return
    except APIError as error:
        with contextlib.suppress(Exception):
            await _send_error(websocket, error)
        return
    await _serve(ready, websocket, generation, flow, fmt)


async def _start(
    ready: Ready, websocket: WebSocket, first: dict[str, Any], size: int
) -> tuple[Generation, StreamFlow, StreamFormat]:
    if first.get("type", "request") != "request":
        raise APIError(
            400, 'The first message must be {"type": "request", "body": {...}}.', param="type"
        )
    service = ready.service
    header = websocket.headers.get("authorization")
    if header is None and isinstance(first.get("api_key"), str):
        header = f"Bearer {first['api_key']}"
    tenant = service.authenticate(header)
    arrival = time.monotonic()
    await service.charge_request(tenant)
    body = first.get("body")
    if not isinstance(body, dict):
        raise APIError(400, "The request message needs a 'body' object.", param="body")
    credits = first.get("credits")
    if credits is not None and (not _is_count(credits) or credits < 0):
        raise APIError(
            400, f"credits must be a non-negative integer; got {credits!r}", param="credits"
        )
    body = {**body, "stream": True}
    prepared = await app_state(websocket).body_workers.run(
        size, lambda: prepare(service, "chat", body)
    )
    generation = await submit_prepared(service, tenant, prepared, arrival)
    flow = StreamFlow(
        generation.stream, generation.request, credit_tokens=credits, siblings=generation.siblings
    )
    if (chain := generation.chain) is not None:
        flow.source, flow.holdup = chain.head, chain.holdup
    return (
        generation,
        flow,
        stream_format(service, prepared, generation.created, generation.priority_label),
    )


async def _serve(
    ready: Ready,
    websocket: WebSocket,
    generation: Generation,
    flow: StreamFlow,
    fmt: StreamFormat,
) -> None:
    service = ready.service
    controller = ready.flow
    controller.register(flow)
    credit_changed = asyncio.Event()
    bad_message: list[APIError] = []
    writer = asyncio.current_task()
    assert writer is not None

    async def read_client() -> None:
        try:
            while True:
                message, _ = await _receive_message(websocket)
                kind = message.get("type")
                if kind == "credit":
                    tokens = message.get("tokens")
                    if not _is_count(tokens) or tokens < 1:
                        raise APIError(
                            400,
                            f"credit tokens must be a positive integer; got {tokens!r}",
                            param="tokens",
                        )
                    if flow.credit_tokens is not None:
                        flow.credit_tokens += tokens
                        controller.check(flow)
                        credit_changed.set()
                elif kind == "cancel":
                    service.cancel(generation)
                    return
                else:
                    raise APIError(
                        400,
                        f"Unknown message type {kind!r}: send 'credit' or 'cancel'.",
                        param="type",
                    )
        except APIError as error:
            bad_message.append(error)
            service.cancel(generation)
            writer.cancel()
        except (WebSocketDisconnect, RuntimeError):
            service.cancel(generation)
            writer.cancel()

    reader = asyncio.create_task(read_client())
    try:
        await _write(
            websocket, ChunkWriter(service, generation, fmt), flow, controller, credit_changed
        )
    except asyncio.CancelledError:
        writer.uncancel()
        if bad_message:
            with contextlib.suppress(Exception):
                await _send_error(websocket, bad_message[0])
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        service.cancel(generation)
        controller.unregister(generation.request_id)
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        if websocket.client_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await websocket.close(CLOSE_NORMAL)


async def _write(
    websocket: WebSocket,
    chunks: ChunkWriter,
    flow: StreamFlow,
    controller: FlowController,
    credit_changed: asyncio.Event,
) -> None:
    """Send the stream's chunks as the client's credit allows, then its end."""
    generation = chunks.generation
    stream = generation.stream
    request = generation.request
    first = chunks.format.role_chunk(
        generation.request_id, request.num_prompt_tokens, request.sampling.n
    )
    if first is not None:
        await websocket.send_text(orjson.dumps(first).decode())
    while True:
        limit = flow.credit_available if flow.credit_tokens is not None else 1 << 30
        output = stream.take(limit) if limit > 0 else None
        if output is None:
            credit_changed.clear()
            waiters = [
                asyncio.ensure_future(stream.wait()),
                asyncio.ensure_future(credit_changed.wait()),
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            continue
        frame = chunks.write(output)
        if frame.chunk is not None:
            await websocket.send_text(orjson.dumps(frame.chunk).decode())
        flow.record_write(0, output.num_new_tokens)
        controller.check(flow)
        if not output.finished:
            continue
        ending = chunks.finish(output)
        if ending.error is not None:
            await _send_error(websocket, ending.error)
            return
        for chunk in ending.chunks:
            await websocket.send_text(orjson.dumps(chunk).decode())
        done = {
            "type": "done",
            "id": generation.request_id,
            "finish_reason": finish_reason_text(output.finish_reason),
            "usage": usage(output),
        }
        await websocket.send_text(orjson.dumps(done).decode())
        await websocket.close(CLOSE_NORMAL)
        return
