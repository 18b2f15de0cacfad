"""A table of hostile inputs: each gets a 4xx in OpenAI's error shape, and the server is
healthy after all of them (no 5xx, no traceback in its log).

Bodies and routes are the app's to refuse: they are sent in process, to one app shared
by the module.  Malformed HTTP is uvicorn's parser's and the connection guard's: it is
written to a real server's socket.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio

from tests.reliability.conftest import (
    FAST_SIM,
    MODEL,
    assert_healthy,
    assert_healthy_in_process,
    assert_openai_error,
)
from tests.support.inprocess import InProcessApp, serve_in_process
from tests.support.servers import ServerProcess

#: The in-process tests share one app, so they share its event loop (the module's).
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(*FAST_SIM) as served:
        yield served


CHAT = "/chat/completions"
COMPLETIONS = "/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


#: (name, path, body: JSON-able or raw bytes, extra headers, expected status)
JSON_CASES: list[tuple[str, str, Any, dict[str, str], int]] = [
    ("bool as max_tokens", CHAT, chat(max_tokens=True), {}, 400),
    ("string as max_tokens", CHAT, chat(max_tokens="10"), {}, 400),
    ("float as max_tokens", CHAT, chat(max_tokens=2.5), {}, 400),
    ("zero max_tokens", CHAT, chat(max_tokens=0), {}, 400),
    ("negative max_tokens", CHAT, chat(max_tokens=-1), {}, 400),
    ("huge max_tokens", CHAT, chat(max_tokens=10**15), {}, 400),
    ("nan temperature", CHAT, chat(temperature="nan"), {}, 400),
    ("inf top_p", CHAT, chat(top_p="inf"), {}, 400),
    ("nan pace", CHAT, chat(max_tokens_per_second="nan"), {}, 400),
    ("-inf pace", CHAT, chat(max_tokens_per_second="-Infinity"), {}, 400),
    ("nan penalty", CHAT, chat(presence_penalty="NaN"), {}, 400),
    ("nan flush interval", CHAT, chat(stream_options={"flush_interval_ms": "nan"}), {}, 400),
    ("nan logit bias", CHAT, chat(logit_bias={"1": "nan"}), {}, 400),
    ("overflowing number", CHAT, b'{"model": "x", "messages": [], "temperature": 1e999}', {}, 400),
    ("top_k beyond the vocabulary", CHAT, chat(top_k=10**12), {}, 400),
    ("seed beyond 64 bits", CHAT, chat(seed=2**70), {}, 400),
    ("bool as n", CHAT, chat(n=True), {}, 400),
    ("int as stream", CHAT, chat(stream=1), {}, 400),
    ("string as stream", CHAT, chat(stream="yes"), {}, 400),
    ("no messages", CHAT, chat(messages=[]), {}, 400),
    ("messages as a string", CHAT, chat(messages="hi"), {}, 400),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400),
    (
        "image part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        {},
        400,
    ),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), {}, 400),
    ("too many stops", CHAT, chat(stop=["x"] * 17), {}, 400),
    ("huge stop", CHAT, chat(stop="x" * 10_000), {}, 400),
    (
        "prompt over the context",
        COMPLETIONS,
        {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4},
        {},
        400,
    ),
    ("negative token id", COMPLETIONS, {"model": MODEL, "prompt": [[-1]]}, {}, 400),
    ("token id beyond the vocabulary", COMPLETIONS, {"model": MODEL, "prompt": [10**9]}, {}, 400),
    ("bools as token ids", COMPLETIONS, {"model": MODEL, "prompt": [True, False]}, {}, 400),
    ("background not a bool", CHAT, chat(background="yes"), {}, 400),
    ("streaming background job", CHAT, chat(background=True, stream=True), {}, 400),
    ("unknown model", CHAT, {**chat(), "model": "gpt-17"}, {}, 404),
    ("array body", CHAT, [], {}, 400),
    ("null body", CHAT, None, {}, 400),
    ("number body", CHAT, 7, {}, 400),
    ("empty body", CHAT, b"", {}, 400),
    ("invalid JSON", CHAT, b'{"model": ', {}, 400),
    ("invalid UTF-8", CHAT, b'{"model": "\xff\xfe"}', {}, 400),
    ("JSON nested 100,000 deep", CHAT, nested(100_000), {}, 400),
    ("a form", CHAT, b"model=x", {"content-type": "application/x-www-form-urlencoded"}, 415),
    (
        "a multipart upload",
        COMPLETIONS,
        b"--b\r\n\r\n--b--",
        {"content-type": "multipart/form-data; boundary=b"},
        415,
    ),
    ("a body over the limit", CHAT, b"x" * (1_048_576 + 1), {}, 413),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status"),
    [case[1:] for case in JSON_CASES],
    ids=[case[0] for case in JSON_CASES],
)
@in_module_loop
async def test_hostile_body_is_a_4xx_in_openai_shape(
    app: InProcessApp, path: str, body: Any, headers: dict[str, str], status: int
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await app.client.post(
        "/v1" + path, content=content, headers={"content-type": "application/json", **headers}
    )
    assert_openai_error(response, status)


ROUTE_CASES = [
    ("unknown route", "GET", "/v1/nothing", 404),
    ("wrong method", "GET", "/v1/chat/completions", 405),
    ("wrong method on a job", "DELETE", "/v1/jobs/job-1", 405),
    ("unknown job", "GET", "/v1/jobs/" + "j" * 2000, 404),
    ("unknown job with odd bytes", "GET", "/v1/jobs/%00%ff", 404),
    ("unknown request to cancel", "POST", "/v1/requests/nope/cancel", 404),
    ("unknown stream", "GET", "/v1/streams/chatcmpl-0000", 404),
]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [case[1:] for case in ROUTE_CASES],
    ids=[case[0] for case in ROUTE_CASES],
)
@in_module_loop
async def test_hostile_route_is_a_4xx_in_openai_shape(
    app: InProcessApp, method: str, path: str, status: int
) -> None:
    assert_openai_error(await app.client.request(method, path), status)


@in_module_loop
async def test_the_app_is_healthy_after_the_tables(app: InProcessApp) -> None:
    await assert_healthy_in_process(app)


RAW_CASES = [
    ("garbage request line", b"GARBAGE\r\n\r\n", 400),
    ("header without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    (
        "non-numeric content-length",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        400,
    ),
    # Headers that never end: cut off at max_header_bytes (64 KiB) rather than buffered.
    ("endless headers", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000, 431),
]


@pytest.mark.parametrize(
    ("raw", "status"), [case[1:] for case in RAW_CASES], ids=[case[0] for case in RAW_CASES]
)
@pytest.mark.slow
def test_malformed_http_is_a_4xx_in_openai_shape(
    open_server: ServerProcess, raw: bytes, status: int
) -> None:
    host, port = open_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    assert b"content-type: application/json" in head.lower(), head
    error = orjson.loads(body)["error"]
    assert error["message"] and error["type"], error


@pytest.mark.slow
def test_server_is_healthy_after_malformed_http(open_server: ServerProcess) -> None:
    assert_healthy(open_server)
