"""An OpenAI-compatible upstream whose answers a test writes: a small ASGI app served by
uvicorn on a free port (a real socket, in a thread of the test's process).  It answers
each call with the events its script gives (chat chunks, completion chunks, tool-call
fragments, several choices), records every body it is sent, and can end an answer
mid-way as an upstream that died would (no finish, no ``[DONE]``), or fall silent before
an event (sending only SSE comments meanwhile, if asked, as another Sluicegate does while
a request waits in its queue)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn

MODEL = "scripted-model"
CONTEXT = 2048


@dataclass(slots=True)
class Answer:
    """One call's answer: its events (each a chunk's ``choices``, one choice, or a whole
    chunk when it has an ``object``), and how many of them go out before it dies (None: all, then
    usage and ``[DONE]``)."""

    events: list[Any]
    dies_after: int | None = None
    #: Event index -> seconds of silence before it (no data; only comments, when
    #: ``comment_every_seconds`` is set).
    silent_before: dict[int, float] = field(default_factory=dict)
    comment_every_seconds: float | None = None


#: What a script answers: the body it was sent and which call this is (0 first).
Script = Callable[[dict[str, Any], int], Answer]


@dataclass(slots=True)
class ScriptedUpstream:
    script: Script
    #: Its /v1/models entry (vLLM's shape by default) and its /props (llama.cpp's).
    model_entry: dict[str, Any] = field(
        default_factory=lambda: {"id": MODEL, "object": "model", "max_model_len": CONTEXT}
    )
    props: dict[str, Any] | None = None
    #: More /v1/models entries (an embedding model, say: ``POST /v1/embeddings`` answers
    #: each input with ``[len(text), index]``, or ``embedding_status`` with an error).
    more_models: list[dict[str, Any]] = field(default_factory=list)
    embedding_status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedUpstream:
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", lifespan="off", interface="asgi3")
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the scripted upstream never started"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    @property
    def calls(self) -> list[dict[str, Any]]:
        """The bodies of the answers asked for (not the gateway's one-token probes)."""
        return [b for b in self.bodies if b.get("max_tokens") != 1]

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/v1/models":
                data = [self.model_entry, *self.more_models]
                await _json(send, 200, {"object": "list", "data": data})
            elif path == "/props" and self.props is not None:
                await _json(send, 200, self.props)
            else:
                await _json(send, 404, {"error": {"message": "not here"}})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = orjson.loads(raw)
        self.bodies.append(body)
        self.paths.append(path)
        if path == "/v1/embeddings":
            await _json(send, self.embedding_status, _embeddings(body, self.embedding_status))
            return
        if body.get("max_tokens") == 1:  # the gateway's latency probe
            answer = Answer([[{"index": 0, "text": "x", "finish_reason": "length"}]])
        else:
            answer = self.script(body, len(self.calls) - 1)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        chat = path.endswith("/chat/completions")
        for i, event in enumerate(answer.events):
            if answer.dies_after is not None and i >= answer.dies_after:
                break
            silence = answer.silent_before.get(i, 0.0)
            if silence and not await _silence(send, receive, silence, answer.comment_every_seconds):
                return  # the gateway went away meanwhile
            if isinstance(event, list):
                chunk = _chunk(event, chat)
            else:
                chunk = event if "object" in event else _chunk([event], chat)
            await send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})
        if answer.dies_after is None:
            usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
            tail = _sse({**_chunk([], chat), "usage": usage}) + b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _silence(send: Any, receive: Any, seconds: float, comment_every: float | None) -> bool:
    """No data for ``seconds``: only SSE comments every ``comment_every`` seconds (a queued
    request's position, a heartbeat), when set.  False when the client went away."""
    deadline = time.monotonic() + seconds
    gone = asyncio.ensure_future(receive())  # the body was read: what comes is a disconnect
    try:
        while (left := deadline - time.monotonic()) > 0:
            wait = left if comment_every is None else min(left, comment_every)
            done, _ = await asyncio.wait({gone}, timeout=wait)
            if done:
                return False
            if comment_every is not None:
                comment = b": queued position=1\n\n"
                await send({"type": "http.response.body", "body": comment, "more_body": True})
        return True
    finally:
        gone.cancel()


def _embeddings(body: dict[str, Any], status: int) -> dict[str, Any]:
    if status != 200:
        return {"error": {"message": "scripted failure", "type": "server_error", "code": None}}
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    data = [
        {"object": "embedding", "index": i, "embedding": [float(len(text)), float(i)]}
        for i, text in enumerate(inputs)
    ]
    usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
    return {"object": "list", "data": data, "model": body["model"], "usage": usage}


def _chunk(choices: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    return {
        "id": "up-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": choices,
    }


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _json(send: Any, status: int, payload: dict[str, Any]) -> None:
    data = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# ---------------------------------------------------------------------------------------
# Chat chunks' choices


def text(content: str, index: int = 0, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"index": index, "delta": {"content": content}, "finish_reason": finish, **extra}


def call_start(position: int, call_id: str, name: str, index: int = 0) -> dict[str, Any]:
    fragment = {
        "index": position,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return {"index": index, "delta": {"tool_calls": [fragment]}, "finish_reason": None}


def call_args(position: int, arguments: str, index: int = 0) -> dict[str, Any]:
    fragment = {"index": position, "function": {"arguments": arguments}}
    return {"index": index, "delta": {"tool_calls": [fragment]}, "finish_reason": None}


def finish(reason: str, index: int = 0) -> dict[str, Any]:
    return {"index": index, "delta": {}, "finish_reason": reason}
