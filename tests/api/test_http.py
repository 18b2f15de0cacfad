"""Raw HTTP, in process: SSE framing and every error status in OpenAI's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.inprocess import InProcessApp, serve_in_process

MODEL = "sluicegate-sim"


@pytest.fixture
async def app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(max_num_seqs=64, max_model_len=1024) as served:
        yield served


@pytest.fixture
def client(app: InProcessApp) -> httpx.AsyncClient:
    return app.client


def chat_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
    }
    body.update(overrides)
    return body


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    message: str = err["message"]
    return message


async def test_sse_framing(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    events = resp.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    for event in events[:-2]:
        if event.startswith(b": "):
            continue  # SSE comments (queue position, keep-alive) are allowed anywhere
        data, _, field = event.partition(b"\n")
        assert data.startswith(b"data: ")
        orjson.loads(data[len(b"data: ") :])
        # Each event carries its resumable position: id: <stream-id>:<seq>.
        assert not field or field.startswith(b"id: ")


@pytest.mark.parametrize(
    ("overrides", "param", "needle"),
    [
        ({"temperature": 3}, "temperature", "between 0 and 2; got 3"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"max_tokens": 0}, "max_tokens", "at least 1; got 0"),
        ({"max_tokens": 5000}, "max_tokens", "maximum context length is 1024"),
        ({"n": 9}, "n", "between 1 and 8; got 9"),
        ({"n": 0}, "n", "at least 1; got 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
        ({"min_p": 1.5}, "min_p", "between 0 and 1"),
        ({"logit_bias": {"the": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"1": 101}}, "logit_bias", "between -100 and 100"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "token ids must be in"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20; got 21"),
        (
            {"tools": [{"type": "function", "function": {"name": "f f"}}]},
            "tools[0].function.name",
            "^[a-zA-Z0-9_-]{1,64}$",
        ),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.role", "role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "only text content parts",
        ),
        ({"stop": ["a"] * 17}, "stop", "at most 16"),
        ({"seed": 2**63}, "seed", "64-bit"),
        ({"max_tokens": "many"}, "max_tokens", "got 'many'"),
    ],
)
async def test_invalid_parameters_are_400(
    client: httpx.AsyncClient, overrides: dict[str, Any], param: str, needle: str
) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(**overrides))
    message = assert_openai_error(resp, 400, param)
    assert needle in message


async def test_missing_field_is_400_not_422(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={"model": MODEL})
    assert "'messages'" in assert_openai_error(resp, 400, "messages")


async def test_bad_json_and_empty_body(client: httpx.AsyncClient) -> None:
    url = "/v1/completions"
    assert_openai_error(await client.post(url, content=b"{nope"), 400)
    assert_openai_error(await client.post(url, content=b""), 400)
    assert_openai_error(await client.post(url, content=b"[1, 2]"), 400)


async def test_unknown_model_404(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(model="x"))
    assert MODEL in assert_openai_error(resp, 404, "model")


async def test_unknown_route_404_and_wrong_method_405(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404)
    assert_openai_error(await client.get("/v1/chat/completions"), 405)


async def test_body_too_large_413(client: httpx.AsyncClient) -> None:
    big = chat_body(messages=[{"role": "user", "content": "x" * 2_000_000}])
    assert_openai_error(await client.post("/v1/chat/completions", json=big), 413)


async def test_prompt_longer_than_context_400(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "y" * 1500, "max_tokens": 4}
    )
    message = assert_openai_error(resp, 400)
    assert "1500 tokens" in message and "1024" in message


async def test_unknown_fields_ignored_and_vllm_extensions_accepted(
    client: httpx.AsyncClient,
) -> None:
    body = chat_body(
        some_future_field={"x": 1},
        ignore_eos=True,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: {")]
    chunks = [orjson.loads(ln[6:]) for ln in lines]
    # continuous_usage_stats: usage on every chunk, growing.
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_completion_with_token_ids(client: httpx.AsyncClient) -> None:
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [104, 105], "max_tokens": 3, "seed": 1}
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == 2
    bad = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 3}
    )
    assert_openai_error(bad, 400, "prompt")


async def test_health_ready(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}
    assert (await client.get("/ready")).status_code == 200
