"""WebSocket credits, explicit cancel and token throttling, through the real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.support.servers import ServerProcess, cancellations

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
#: Only a broken server takes this long to answer, pause or end; a slow one never does.
DEADLINE_SECONDS = 30.0


def ws_url(server: ServerProcess) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/ws"


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "credits"}],
        "max_tokens": max_tokens,
        "seed": 9,
        "ignore_eos": True,
        **extra,
    }


def receive_tokens(
    ws: Any, timeout: float, until: Callable[[str], bool] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Messages until the answer ends (``done`` or ``error``), ``until(text)`` holds, or
    ``timeout`` passes."""
    text = ""
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (until is not None and until(text)):
        try:
            raw = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
        except (TimeoutError, ConnectionClosed):
            break
        message = orjson.loads(raw)
        messages.append(message)
        if message.get("object") == "chat.completion.chunk" and message["choices"]:
            text += message["choices"][0]["delta"].get("content") or ""
        if message.get("type") in ("done", "error"):
            break
    return text, messages


def test_websocket_credits_pause_and_resume(sim_server: ServerProcess) -> None:
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps({"type": "request", "body": chat(40), "credits": 5}).decode())
        # Zero credit left: paused like a full buffer (however long the machine takes).
        deadline = time.monotonic() + DEADLINE_SECONDS
        while sim_server.stats()["requests_paused"] != 1:
            assert time.monotonic() < deadline, sim_server.stats()
            time.sleep(0.02)
        # Byte-level sim tokenizer: 5 tokens are 5 bytes (a character spanning the credit's
        # end is held back: at least 3 come).  Then a moment more, for anything beyond the
        # credit to show (none may: the sequence is paused).
        text, _ = receive_tokens(ws, DEADLINE_SECONDS, until=lambda t: len(t.encode()) >= 3)
        more, _ = receive_tokens(ws, 0.2)
        text += more
        assert 3 <= len(text.encode()) <= 5
        ws.send(orjson.dumps({"type": "credit", "tokens": 100}).decode())
        rest, messages = receive_tokens(ws, DEADLINE_SECONDS)
        assert messages[-1]["type"] == "done"
        assert messages[-1]["usage"]["completion_tokens"] == 40
        assert len((text + rest).encode()) == 40


def test_websocket_errors_and_cancel(sim_server: ServerProcess) -> None:
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps({"type": "request", "body": {**chat(5), "model": "nope"}}).decode())
        _, messages = receive_tokens(ws, DEADLINE_SECONDS)
        assert messages[-1]["type"] == "error"
        assert messages[-1]["error"]["code"] == "model_not_found"
    cancelled_before = cancellations(sim_server)
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps({"type": "request", "body": chat(900)}).decode())
        ws.recv(timeout=DEADLINE_SECONDS)
        ws.send(orjson.dumps({"type": "cancel"}).decode())
        _, messages = receive_tokens(ws, DEADLINE_SECONDS)
        assert messages[-1]["type"] == "done"
    deadline = time.monotonic() + DEADLINE_SECONDS
    while sim_server.stats()["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sim_server.stats()["requests_running"] == 0
    assert cancellations(sim_server) - cancelled_before == 1


def test_cancel_endpoint_stops_a_stream(sim_server: ServerProcess) -> None:
    cancelled_before = cancellations(sim_server)
    # Paced at 100 tokens/s, the whole answer would take at least 10 s: the cancel below
    # comes long before, however slow the machine.
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 1000,
        "max_tokens_per_second": 100,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", sim_server.v1 + "/completions", json=body, timeout=DEADLINE_SECONDS
    ) as resp:
        request_id = resp.headers["x-request-id"]
        token = {"x-sluicegate-resume-token": resp.headers.get("x-sluicegate-resume-token", "")}
        lines = resp.iter_lines()
        next(lines)
        cancel = f"{sim_server.v1}/requests/{request_id}/cancel"
        unknown = httpx.post(f"{sim_server.v1}/requests/cmpl-unknown/cancel", timeout=5)
        no_token = httpx.post(cancel, timeout=5)  # open mode: the id alone is not enough
        wrong = httpx.post(cancel, headers={"x-sluicegate-resume-token": "guess"}, timeout=5)
        assert unknown.status_code == no_token.status_code == wrong.status_code == 404
        assert {r.json()["error"]["code"] for r in (unknown, no_token, wrong)} == {"not_found"}
        cancelled = httpx.post(cancel, headers=token, timeout=5)
        assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert sum(len(c["choices"][0]["text"]) for c in chunks if c["choices"]) < 1000
    assert cancellations(sim_server) - cancelled_before == 1


def test_max_tokens_per_second_throttles_one_request(sim_server: ServerProcess) -> None:
    finished: list[str] = []

    def timed(name: str, extra: dict[str, Any], out: list[float]) -> None:
        started = time.monotonic()
        r = httpx.post(
            sim_server.v1 + "/completions",
            json={"model": MODEL, "prompt": "pace", "max_tokens": 20, "ignore_eos": True, **extra},
            timeout=DEADLINE_SECONDS,
        )
        assert r.status_code == 200
        out.append(time.monotonic() - started)
        finished.append(name)

    throttled: list[float] = []
    free: list[float] = []
    t = threading.Thread(target=timed, args=("throttled", {"max_tokens_per_second": 20}, throttled))
    t.start()
    timed("free", {}, free)  # runs beside it at full speed
    t.join()
    # 20 tokens at 20/s take at least 19 intervals, however fast the machine.
    assert throttled[0] >= 19 / 20 * 0.9
    # The one beside it is not held back: its 20 steps of 1 ms take tens of milliseconds
    # here, so it ends first even on a loaded machine (it would end with the throttled
    # one if the pace held the batch).  How fast the rest of the batch runs is the
    # scheduler's tests' (fake clock).
    assert finished == ["free", "throttled"], (free, throttled)


def test_websocket_chunks_are_the_sse_chunks(sim_server: ServerProcess) -> None:
    """One writer makes both: the role chunk, the text, the finish chunk and the usage
    chunk arrive over a WebSocket as over SSE."""
    body = chat(24, stream_options={"include_usage": True})
    sse: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        sim_server.v1 + "/chat/completions",
        json={**body, "stream": True},
        timeout=DEADLINE_SECONDS,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                sse.append(orjson.loads(line[6:]))
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps({"type": "request", "body": body}).decode())
        _, messages = receive_tokens(ws, DEADLINE_SECONDS)
    assert messages[-1]["type"] == "done"
    over_ws = messages[:-1]

    def shape(chunks: list[dict[str, Any]]) -> tuple[object, ...]:
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        return (
            chunks[0]["choices"][0]["delta"],  # the role
            text,
            chunks[-2]["choices"][0]["finish_reason"],
            chunks[-1]["choices"],  # the usage chunk has none
            chunks[-1]["usage"]["completion_tokens"],
            {c["object"] for c in chunks},
        )

    assert shape(over_ws) == shape(sse)
    assert shape(sse)[0] == {"role": "assistant", "content": ""}
    assert shape(sse)[2:5] == ("length", [], 24)
