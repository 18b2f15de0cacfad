"""Raw HTTP: SSE framing and every error status in OpenAI's shape."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


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


def test_sse_framing(sim_server: ServerProcess) -> None:
    with httpx.stream(
        "POST", sim_server.v1 + "/chat/completions", json=chat_body(stream=True), timeout=10
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-cache"
        assert resp.headers["x-accel-buffering"] == "no"
        raw = b"".join(resp.iter_bytes())
    events = raw.split(b"\n\n")
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
        ({"n": 3}, "n", "only n=1"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
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
def test_invalid_parameters_are_400(
    sim_server: ServerProcess, overrides: dict[str, Any], param: str, needle: str
) -> None:
    resp = httpx.post(sim_server.v1 + "/chat/completions", json=chat_body(**overrides), timeout=10)
    message = assert_openai_error(resp, 400, param)
    assert needle in message


def test_missing_field_is_400_not_422(sim_server: ServerProcess) -> None:
    resp = httpx.post(sim_server.v1 + "/chat/completions", json={"model": MODEL}, timeout=10)
    assert "'messages'" in assert_openai_error(resp, 400, "messages")


def test_bad_json_and_empty_body(sim_server: ServerProcess) -> None:
    url = sim_server.v1 + "/completions"
    assert_openai_error(httpx.post(url, content=b"{nope", timeout=10), 400)
    assert_openai_error(httpx.post(url, content=b"", timeout=10), 400)
    assert_openai_error(httpx.post(url, content=b"[1, 2]", timeout=10), 400)


def test_unknown_model_404(sim_server: ServerProcess) -> None:
    resp = httpx.post(sim_server.v1 + "/chat/completions", json=chat_body(model="x"), timeout=10)
    assert MODEL in assert_openai_error(resp, 404, "model")


def test_unknown_route_404_and_wrong_method_405(sim_server: ServerProcess) -> None:
    assert_openai_error(httpx.get(sim_server.v1 + "/nothing", timeout=10), 404)
    assert_openai_error(httpx.get(sim_server.v1 + "/chat/completions", timeout=10), 405)


def test_body_too_large_413(sim_server: ServerProcess) -> None:
    big = chat_body(messages=[{"role": "user", "content": "x" * 2_000_000}])
    assert_openai_error(httpx.post(sim_server.v1 + "/chat/completions", json=big, timeout=10), 413)


def test_prompt_longer_than_context_400(sim_server: ServerProcess) -> None:
    resp = httpx.post(
        sim_server.v1 + "/completions",
        json={"model": MODEL, "prompt": "y" * 1500, "max_tokens": 4},
        timeout=10,
    )
    message = assert_openai_error(resp, 400)
    assert "1500 tokens" in message and "1024" in message


def test_unknown_fields_ignored_and_vllm_extensions_accepted(sim_server: ServerProcess) -> None:
    body = chat_body(
        some_future_field={"x": 1},
        ignore_eos=True,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    with httpx.stream("POST", sim_server.v1 + "/chat/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
    chunks = [orjson.loads(ln[6:]) for ln in lines]
    # continuous_usage_stats: usage on every chunk, growing.
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_completion_with_token_ids(sim_server: ServerProcess) -> None:
    resp = httpx.post(
        sim_server.v1 + "/completions",
        json={"model": MODEL, "prompt": [104, 105], "max_tokens": 3, "seed": 1},
        timeout=10,
    )
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == 2
    bad = httpx.post(
        sim_server.v1 + "/completions",
        json={"model": MODEL, "prompt": [10**9], "max_tokens": 3},
        timeout=10,
    )
    assert_openai_error(bad, 400, "prompt")


def test_health_ready(sim_server: ServerProcess) -> None:
    assert httpx.get(sim_server.base_url + "/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(sim_server.base_url + "/ready", timeout=5).status_code == 200
