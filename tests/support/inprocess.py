"""The whole app in the test's own event loop: ``create_app`` with its lifespan run, talked
to through ``httpx.ASGITransport``.  No process and no port: milliseconds to start, and
the same routes, admission, queue, engine core (the sim's thread) and stream writers as a
served app.

What it cannot show is what only sockets show (flow control against a slow socket,
connection limits, signals, replicas): those tests start a real server
(:mod:`tests.support.servers`).  ``ASGITransport`` hands a response over when the app has
sent all of it, so a stream is read whole, after its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from openai import AsyncOpenAI

from sluicegate.api.app import create_app
from sluicegate.api.state import AppState
from sluicegate.bench.scrape import MetricsSnapshot, parse_metrics
from sluicegate.config import load_settings
from sluicegate.engine.embedded import EmbeddedCore
from sluicegate.scheduler.step import StepPlan
from sluicegate.service.service import Service

BASE_URL = "http://sluicegate.test"

#: The sim engine at ~1 ms a step: fast, and slow enough for requests to overlap.
FAST_SIM: dict[str, Any] = {
    "engine": "sim",
    "sim_step_base_ms": 1.0,
    "sim_step_per_token_ms": 0.01,
}


#: How long a test waits for a server to go idle: only a leaked seat takes this long.
IDLE_TIMEOUT_SECONDS = 30.0


@dataclass(slots=True)
class InProcessApp:
    """A running app and an HTTP client for it."""

    app: FastAPI
    state: AppState
    client: httpx.AsyncClient

    @property
    def service(self) -> Service:
        assert self.state.ready is not None
        return self.state.ready.service

    def openai(self, api_key: str = "none", **options: Any) -> AsyncOpenAI:
        """The official client, unmodified, over this app."""
        return AsyncOpenAI(
            base_url=BASE_URL + "/v1", api_key=api_key, http_client=self.client, **options
        )

    async def stats(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        response = await self.client.get("/v1/stats", headers=headers)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    async def idle(self) -> dict[str, Any]:
        """The stats once nothing runs or waits.  A request's seat is released just after
        its last byte is sent, so a test that has read every answer polls; a seat that
        stays taken (a leak) misses the generous deadline."""
        async with asyncio.timeout(IDLE_TIMEOUT_SECONDS):
            while True:
                stats = await self.stats()
                if not stats["requests_running"] and not stats["requests_waiting"]:
                    return stats
                await asyncio.sleep(0.02)

    async def metrics(self, headers: dict[str, str] | None = None) -> MetricsSnapshot:
        response = await self.client.get("/metrics", headers=headers)
        response.raise_for_status()
        return parse_metrics(response.text)


def settings_from_args(args: list[str]) -> dict[str, Any]:
    """``sluicegate serve`` flags as settings (``--max-num-seqs 4`` -> ``max_num_seqs='4'``,
    ``--no-pause`` -> ``pause=False``, a repeated flag -> a list), so that a test written
    against a server process reads the same in process.  Values stay strings: the
    settings parse them as the CLI does."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"not a flag: {flag!r}"
        name = flag[2:].replace("-", "_")
        value: Any
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 2
        elif name.startswith("no_"):
            name, value, i = name[3:], False, i + 1
        else:
            value, i = True, i + 1
        if name in out:
            previous = out[name]
            out[name] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            out[name] = value
    return out


@contextlib.asynccontextmanager
async def serve_in_process(
    *args: str, ready_timeout_seconds: float = 60.0, **settings: Any
) -> AsyncIterator[InProcessApp]:
    """The app with ``settings`` (over :data:`FAST_SIM`; ``args`` as ``serve`` flags),
    ready.  Its stages stop when the block ends."""
    values = {**FAST_SIM, **settings_from_args(list(args)), **settings}
    config = values.pop("config", None)
    if isinstance(config, Path):
        config = str(config)
    with tempfile.TemporaryDirectory(prefix="sluicegate-inprocess-") as scratch:
        # Its own job journal (unless the test places it): one app's background jobs (a
        # background response's, say) are not run again by the next, as a restarted
        # server's would be.
        if "journal_path" not in values and "cache_dir" not in values:
            values["journal_path"] = str(Path(scratch) / "jobs.sqlite3")
        async with _served(load_settings(config, **values), ready_timeout_seconds) as served:
            yield served


@contextlib.asynccontextmanager
async def _served(settings: Any, ready_timeout_seconds: float) -> AsyncIterator[InProcessApp]:
    app = create_app(settings)
    state = app.state.sluicegate
    assert isinstance(state, AppState)
    async with app.router.lifespan_context(app):
        async with asyncio.timeout(ready_timeout_seconds):
            while state.ready is None:
                if state.load_error is not None:
                    raise RuntimeError(state.load_error)
                await asyncio.sleep(0.005)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield InProcessApp(app, state, client)


# --------------------------------------------------------------------------------------
# Waiting for a condition; holding the engine; streaming responses as they are written


async def wait_until(
    condition: Callable[[], Awaitable[bool] | bool], what: str, within_seconds: float = 30.0
) -> None:
    """Poll ``condition`` (a function or a coroutine function) until it holds.  The
    deadline is generous on purpose: only a broken server misses it, never a slow one."""
    deadline = time.monotonic() + within_seconds
    while True:
        holds = condition()
        if inspect.isawaitable(holds):
            holds = await holds
        if holds:
            return
        assert time.monotonic() < deadline, f"timed out after {within_seconds:g}s: {what}"
        await asyncio.sleep(0.005)


class EngineGate:
    """A gate in front of every step of the app's engine (see :func:`gate_engine`).

    Closed, the engine thread waits before it schedules its next step: nothing runs, ends
    or frees a seat, while requests still pass admission, wait in the queue and are
    dispatched to the seats that are free.  What the queue and the seats hold stays
    exactly as the test made it, however slow the machine.  :meth:`allow` lets a number
    of steps through (each gives every running sequence at most one token), so a test can
    advance streams by a bounded amount.  The wait is outside the step's timing: the cost
    model learns nothing from it.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        #: Steps that may still pass (None: open).
        self._budget: int | None = 0
        self._waiting = False
        #: Steps that have passed the gate.
        self.num_steps = 0
        #: Request ids in the order the engine first ran them.
        self.first_run: list[str] = []

    def open(self) -> None:
        with self._condition:
            self._budget = None
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._budget = 0

    def allow(self, steps: int) -> None:
        """Let ``steps`` more steps through, then close."""
        with self._condition:
            self._budget = (self._budget or 0) + steps
            self._condition.notify_all()

    @property
    def holding(self) -> bool:
        """The engine thread is waiting at the closed gate (its last step is done)."""
        with self._condition:
            return self._waiting and self._budget == 0

    async def step_until(
        self, condition: Callable[[], bool], what: str, max_steps: int = 50
    ) -> None:
        """Let the engine run one step at a time until ``condition`` holds, checked once
        each step is done and its output had a moment to reach its readers.  At most
        ``max_steps`` steps: a test bounds how far its streams can get."""
        for step in range(max_steps + 1):
            for _ in range(20):  # outputs posted by the last step reach their readers
                if condition():
                    return
                await asyncio.sleep(0.001)
            if step < max_steps:
                self.allow(1)
                await wait_until(functools.partial(self._ran, self.num_steps + 1), what)
        raise AssertionError(f"{what}: not after {max_steps} steps")

    def _ran(self, num_steps: int) -> bool:
        """``num_steps`` steps are done: the engine thread is back at the closed gate
        (there is always a next step while a sequence is running)."""
        return self.num_steps >= num_steps and self.holding

    def _pass(self) -> None:  # the engine thread
        with self._condition:
            self._waiting = True
            while self._budget == 0:
                self._condition.wait()
            self._waiting = False
            if self._budget is not None:
                self._budget -= 1
            self.num_steps += 1


@contextlib.contextmanager
def gate_engine(app: InProcessApp, *, closed: bool = True) -> Iterator[EngineGate]:
    """A gate in front of the engine's steps for the block (closed at first, unless
    ``closed=False``); opened when the block ends, whatever happens in it."""
    core = app.service.core
    assert isinstance(core, EmbeddedCore), "the gate holds the embedded engine's scheduler"
    scheduler = core.scheduler
    schedule = scheduler.schedule
    gate = EngineGate()
    if not closed:
        gate.open()
    seen: set[str] = set()

    def gated_schedule() -> StepPlan:  # the engine thread
        gate._pass()
        plan = schedule()
        for sequence in plan.sequences:
            if sequence.request_id not in seen:
                seen.add(sequence.request_id)
                gate.first_run.append(sequence.request_id)
        return plan

    scheduler.schedule = gated_schedule  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.open()
        scheduler.schedule = schedule  # type: ignore[method-assign]


class _StreamedBody(httpx.AsyncByteStream):
    """A response body as the app writes it; closing it early is the client leaving."""

    def __init__(
        self, chunks: asyncio.Queue[bytes | None], left: asyncio.Event, app_task: asyncio.Task[None]
    ) -> None:
        self._chunks = chunks
        self._left = left
        self._app_task = app_task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk

    async def aclose(self) -> None:
        self._left.set()  # the app's next receive() is http.disconnect
        await self._app_task  # it must end once its client has gone (or raise what it raised)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """``httpx.ASGITransport``, except that a response is handed over at its start and
    its body read as the app writes it, and that a client that stops reading early
    (leaves ``client.stream(...)``) disconnects: the app's ``receive()`` says
    ``http.disconnect``, as uvicorn's does when a socket closes.  There is no socket:
    nothing a socket would show (flow control, a slow reader) happens here."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for (k, v) in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port),
            "client": ("127.0.0.1", 123),
            "root_path": "",
        }
        body = request.stream.__aiter__()
        body_sent = False
        left = asyncio.Event()
        started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = (
            asyncio.get_running_loop().create_future()
        )
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                try:
                    chunk = await body.__anext__()
                except StopAsyncIteration:
                    body_sent = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                return {"type": "http.request", "body": chunk, "more_body": True}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if left.is_set():
                return  # as uvicorn: what is written after the client left goes nowhere
            if message["type"] == "http.response.start":
                started.set_result((message["status"], list(message.get("headers", []))))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    chunks.put_nowait(message["body"])
                if not message.get("more_body", False):
                    chunks.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except BaseException as error:
                if not started.done():
                    started.set_exception(error)
                raise
            finally:
                chunks.put_nowait(None)

        app_task = asyncio.create_task(run())
        first: set[asyncio.Future[Any]] = {started, app_task}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            await app_task  # it ended without answering: raise what it raised
            raise AssertionError("the app ended without starting a response")
        status, headers = started.result()
        return httpx.Response(
            status, headers=headers, stream=_StreamedBody(chunks, left, app_task), request=request
        )


@contextlib.asynccontextmanager
async def streaming_client(app: InProcessApp) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for ``app`` that reads responses as they are written (a stream
    line by line while it is generated, its headers at once) and that disconnects when
    it leaves a response early (:class:`StreamingASGITransport`)."""
    transport = StreamingASGITransport(app.app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
        yield client


# --------------------------------------------------------------------------------------
# A WebSocket without a socket


class InProcessWebSocket:
    """A client's end of a WebSocket to the app, as ASGI messages (no socket, no frames:
    what only a socket shows is not here).  See :func:`websocket_connect`."""

    def __init__(self, app: FastAPI, path: str, headers: dict[str, str] | None) -> None:
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        #: The close code the app sent, once it has closed.
        self.close_code: int | None = None
        scope = {
            "type": "websocket",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "scheme": "ws",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "client": ("127.0.0.1", 123),
            "server": ("sluicegate.test", 80),
            "subprotocols": [],
        }
        self._to_app.put_nowait({"type": "websocket.connect"})
        self._task = asyncio.create_task(self._run(app, scope))

    async def _run(self, app: FastAPI, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._to_app.get, self._from_app.put)
        finally:
            await self._from_app.put({"type": "websocket.close", "code": 1006})

    async def accepted(self) -> None:
        message = await self._from_app.get()
        assert message["type"] == "websocket.accept", message

    async def send_text(self, text: str) -> None:
        await self._to_app.put({"type": "websocket.receive", "text": text})

    async def receive_text(self, timeout_seconds: float = 30.0) -> str:
        """The next text message; ``ConnectionError`` once the app has closed."""
        if self.close_code is not None:
            raise ConnectionError(f"closed ({self.close_code})")
        async with asyncio.timeout(timeout_seconds):
            message = await self._from_app.get()
        if message["type"] == "websocket.close":
            self.close_code = int(message.get("code", 1000))
            raise ConnectionError(f"closed ({self.close_code})")
        assert message["type"] == "websocket.send" and message.get("text") is not None, message
        return str(message["text"])

    async def close(self) -> None:
        """The client goes (or has seen the close): the app's next receive says so."""
        await self._to_app.put({"type": "websocket.disconnect", "code": 1000})
        await self._task  # it must end once its client has gone (or raise what it raised)


@contextlib.asynccontextmanager
async def websocket_connect(
    app: InProcessApp, path: str, headers: dict[str, str] | None = None
) -> AsyncIterator[InProcessWebSocket]:
    """A WebSocket to ``app`` at ``path``, accepted; closed when the block ends."""
    websocket = InProcessWebSocket(app.app, path, headers)
    try:
        await websocket.accepted()
        yield websocket
    finally:
        await websocket.close()
