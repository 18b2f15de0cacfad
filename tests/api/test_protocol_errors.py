"""What the API says about itself and at its edges: the published OpenAPI document, bad
WebSocket messages, a client that leaves half-way through its body."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

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


def test_openapi_publishes_the_request_bodies_and_400_not_422(sim_server: ServerProcess) -> None:
    document = httpx.get(sim_server.base_url + "/openapi.json", timeout=5).json()
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


def ws_url(server: ServerProcess) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/ws"


def closing_error(ws: ClientConnection) -> tuple[dict[str, Any], int | None]:
    """Read until the server closes: its error frame, and the close code."""
    error: dict[str, Any] | None = None
    try:
        while True:
            message = orjson.loads(ws.recv(timeout=5))
            if message.get("type") == "error":
                error = message
    except ConnectionClosed:
        pass
    assert error is not None, "no error frame before the close"
    assert error["error"]["message"] and error["error"]["type"], error
    return error, ws.close_code


@pytest.mark.parametrize(
    "first", ["not json", b"\x00binary", "[1, 2]", '{"type": "dance"}'], ids=repr
)
def test_a_bad_first_websocket_message_closes_1003_with_an_error(
    sim_server: ServerProcess, first: str | bytes
) -> None:
    with connect(ws_url(sim_server)) as ws:
        ws.send(first)
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
def test_a_bad_message_mid_stream_closes_1003_with_an_error(
    sim_server: ServerProcess, bad: str
) -> None:
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
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps(request).decode())
        first = orjson.loads(ws.recv(timeout=10))
        assert first["object"] == "chat.completion.chunk", first
        ws.send(bad)
        _, code = closing_error(ws)
    assert code == 1003


def test_a_bool_is_not_a_credit_count_in_the_first_message(sim_server: ServerProcess) -> None:
    request = {"type": "request", "credits": True, "body": {"model": MODEL, "messages": []}}
    with connect(ws_url(sim_server)) as ws:
        ws.send(orjson.dumps(request).decode())
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
        time.sleep(0.3)  # the server is reading the body now
    deadline = time.monotonic() + 5
    while "left while sending its body" not in sim_server.log()[before:]:
        assert time.monotonic() < deadline, sim_server.log()[before:]
        time.sleep(0.05)
    time.sleep(0.3)
    written = sim_server.log()[before:]
    lines = [line for line in written.splitlines() if "sluicegate.requests" not in line]
    assert "Traceback" not in written, written
    assert len([line for line in lines if "body" in line or "disconnect" in line]) == 1, lines
