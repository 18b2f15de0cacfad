"""What the API says about itself and at its edges: the published OpenAPI document and bad
WebSocket messages (in process), a client that leaves half-way through its body (a real
server: what a closed socket does is the point)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient, WebSocketTestSession
from starlette.websockets import WebSocketDisconnect

from sluicegate.api.app import create_app
from sluicegate.config import load_settings
from tests.support.inprocess import FAST_SIM, serve_in_process
from tests.support.servers import ServerProcess, start_server

MODEL = "sluicegate-sim"


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of this module's own (its log is read), with fixed limits only, so that
    what other tests left running cannot delay or refuse these requests."""
    journal = tmp_path_factory.mktemp("protocol") / "jobs.sqlite3"
    server = start_server(
        ["--engine", "sim", "--admission", "static", "--journal-path", str(journal)], "protocol"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ws_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The app in process, with its lifespan, for WebSocket sessions (Starlette's test
    client runs it on a thread of its own: no process, no port)."""
    journal: Path = tmp_path_factory.mktemp("protocol-ws") / "jobs.sqlite3"
    settings = load_settings(**FAST_SIM, admission="static", journal_path=str(journal))
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the app never became ready"
            time.sleep(0.01)
        yield client


async def test_openapi_publishes_the_request_bodies_and_400_not_422() -> None:
    async with serve_in_process() as app:
        document = (await app.client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert set(operation["responses"]) >= {"200", "400", "401", "404", "413", "415", "429"}
        assert "text/event-stream" in operation["responses"]["200"]["content"]
    for item in document["paths"].values():
        for operation in item.values():
            assert "422" not in operation["responses"], operation
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"messages"}  # the model may be left out: the one served
    assert {"max_tokens", "temperature", "stream", "background"} <= set(chat["properties"])
    error = document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]["404"]
    assert error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


def closing_error(ws: WebSocketTestSession) -> tuple[dict[str, Any], int]:
    """Read until the server closes: its error frame, and the close code."""
    error: dict[str, Any] | None = None
    try:
        while True:
            message = orjson.loads(ws.receive_text())
            if message.get("type") == "error":
                error = message
    except WebSocketDisconnect as closed:
        code = closed.code
    assert error is not None, "no error frame before the close"
    assert error["error"]["message"] and error["error"]["type"], error
    return error, code


@pytest.mark.parametrize(
    "first", ["not json", b"\x00binary", "[1, 2]", '{"type": "dance"}'], ids=repr
)
def test_a_bad_first_websocket_message_closes_1003_with_an_error(
    ws_app: TestClient, first: str | bytes
) -> None:
    with ws_app.websocket_connect("/v1/ws") as ws:
        if isinstance(first, bytes):
            ws.send_bytes(first)
        else:
            ws.send_text(first)
        _, code = closing_error(ws)
    assert code == 1003


@pytest.mark.parametrize(
    "bad",
    [
        '{"type": "credit", "tokens": true}',
        '{"type": "credit", "tokens": -5}',
        '{"type": "wat"}',
        "garbage",
    ],
    ids=repr,
)
def test_a_bad_message_mid_stream_closes_1003_with_an_error(ws_app: TestClient, bad: str) -> None:
    # 8 tokens of credit hold at least one whole character (the sim's tokens are bytes).
    request = {
        "type": "request",
        "credits": 8,
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "seed": 7,
        },
    }
    with ws_app.websocket_connect("/v1/ws") as ws:
        ws.send_text(orjson.dumps(request).decode())
        first = orjson.loads(ws.receive_text())
        assert first["object"] == "chat.completion.chunk", first
        ws.send_text(bad)
        _, code = closing_error(ws)
    assert code == 1003


def test_a_bool_is_not_a_credit_count_in_the_first_message(ws_app: TestClient) -> None:
    request = {"type": "request", "credits": True, "body": {"model": MODEL, "messages": []}}
    with ws_app.websocket_connect("/v1/ws") as ws:
        ws.send_text(orjson.dumps(request).decode())
        error, code = closing_error(ws)
    assert code == 1003 and error["error"]["param"] == "credits"


def test_a_client_leaving_mid_body_is_one_log_line(sim_server: ServerProcess) -> None:
    before = len(sim_server.log())
    host, port = sim_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": "sluicegate-sim", '
        )
        # Most likely the server is reading the body after this; either way it must see a
        # client that left mid-body.
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while "left while sending its body" not in sim_server.log()[before:]:
        assert time.monotonic() < deadline, sim_server.log()[before:]
        time.sleep(0.05)
    time.sleep(0.3)  # a window for any second line (a slow machine can only narrow it)
    written = sim_server.log()[before:]
    lines = [line for line in written.splitlines() if "sluicegate.requests" not in line]
    assert "Traceback" not in written, written
    assert len([line for line in lines if "body" in line or "disconnect" in line]) == 1, lines
