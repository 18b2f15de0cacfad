"""The gateway in front of llama.cpp's ``llama-server`` on the SmolLM2 GGUF the embedded
engine serves, when a binary is found (``SLUICEGATE_LLAMA_SERVER`` or ``llama-server`` on
the PATH; docs/upstream.md says how to build one from the llama.cpp source inside the
``llama-cpp-python`` sdist; CI never builds it)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.upstream.test_peers import MODEL, QUESTION, Peer, gateway_for, stream_text

pytestmark = pytest.mark.slow

BINARY = os.environ.get("SLUICEGATE_LLAMA_SERVER") or shutil.which("llama-server")
if not BINARY:
    pytest.skip(
        "no llama-server binary (set SLUICEGATE_LLAMA_SERVER; docs/upstream.md)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def llama_server() -> Iterator[Peer]:
    from sluicegate.engine.torch import default_model_path

    gguf = default_model_path()
    args = [str(BINARY), "-m", gguf, "-t", "2", "-np", "4", "-c", "4096", "--metrics", "--slots"]
    peer = Peer("llama-server", args, {}, model=Path(gguf).name)
    yield peer
    peer.stop()


def test_llama_server_answers_pass_through_unchanged(llama_server: Peer, tmp_path: Path) -> None:
    gateway = gateway_for([(llama_server.base_url, llama_server.model)], "llama", tmp_path)
    try:
        direct = llama_server.chat(QUESTION, 12)
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0.0}
        assert stream_text(gateway, body)[0] == direct
        # Its /metrics are read: a line inside it would show as waiting there.
        upstream = next(iter(gateway.stats()["upstreams"].values()))
        assert upstream["healthy"]
    finally:
        gateway.stop()


def llama_processing(peer: Peer) -> float:
    """Requests ``llama-server`` itself says it is processing (its own counter)."""
    text = httpx.get(peer.base_url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("llamacpp:requests_processing")]
    return float(lines[0].split()[-1]) if lines else -1.0


def test_a_disconnect_stops_llama_servers_generation(llama_server: Peer, tmp_path: Path) -> None:
    gateway = gateway_for([(llama_server.base_url, llama_server.model)], "llama-cancel", tmp_path)
    try:
        port = int(gateway.base_url.rsplit(":", 1)[1])
        body = {
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        stream = open_stream("127.0.0.1", port, "/v1/chat/completions", body)
        events = stream.events()
        for _ in range(5):
            next(events)
        assert llama_processing(llama_server) == 1.0
        started = time.monotonic()
        stream.close()
        # Its own counter falls to 0 at once, not after 2,000 tokens (~20 s).
        while llama_processing(llama_server) != 0.0:
            assert time.monotonic() - started < 5, "llama-server still generating"
            time.sleep(0.1)
    finally:
        gateway.stop()


def test_a_paused_reader_on_llama_server_continues_token_identically(
    llama_server: Peer, tmp_path: Path
) -> None:
    """A reader that stops reading is paused; after ``pause_preempt_seconds`` its
    llama-server request is closed, and when it reads again the answer continues with a
    chat continuation (the partial answer as an assistant prefill).  Greedy, the text
    is the same as an uninterrupted answer's."""
    messages = [{"role": "user", "content": "Write a long story about a dragon."}]
    direct = llama_server.chat(messages, 300)
    gateway = gateway_for(
        [(llama_server.base_url, llama_server.model)],
        "llama-pause",
        tmp_path,
        "--pause-preempt-seconds",
        "0.5",
        "--high-water-tokens",
        "32",
        "--low-water-tokens",
        "8",
        "--flush-interval-ms",
        "0",
        "--socket-send-buffer-bytes",
        "4096",
        "--transport-write-buffer-bytes",
        "4096",
        "--stall-timeout-seconds",
        "60",
    )
    try:
        port = int(gateway.base_url.rsplit(":", 1)[1])
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 300,
            "temperature": 0.0,
            "stream": True,
        }
        slow = open_stream(
            "127.0.0.1", port, "/v1/chat/completions", body, receive_buffer_bytes=4096
        )
        events = slow.events(max_read_bytes=256)
        text = "".join(event_text(next(events)) or "" for _ in range(3))
        deadline = time.monotonic() + 20
        while gateway.stats()["preemptions_total"] < 1:
            assert time.monotonic() < deadline, "the paused request kept its upstream"
            time.sleep(0.1)
        for event in events:
            if event.data == b"data: [DONE]":
                break
            text += event_text(event) or ""
        slow.close()
        assert text == direct
    finally:
        gateway.stop()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llama_jinja() -> Iterator[Peer]:
    """llama-server with ``--jinja``: it serves ``tools`` (SmolLM2's template has none,
    so it describes them in its generic format and constrains the call by grammar).  Two
    slots of 2,048 tokens each."""
    from sluicegate.engine.torch import default_model_path

    gguf = default_model_path()
    args = [str(BINARY), "-m", gguf, "-t", "2", "-np", "2", "-c", "4096", "--jinja"]
    peer = Peer("llama-server-jinja", args, {}, model=Path(gguf).name)
    yield peer
    peer.stop()


def call_parts(calls: list[dict[str, object]]) -> list[tuple[object, object]]:
    """(name, arguments) of each call: ids are the engine's own random ones."""
    parts = []
    for call in calls:
        function = call["function"]
        assert isinstance(function, dict)
        parts.append((function["name"], function["arguments"]))
    return parts


def test_tools_pass_through_to_llama_server(llama_jinja: Peer, tmp_path: Path) -> None:
    body: dict[str, object] = {
        "model": llama_jinja.model,
        "messages": WEATHER_QUESTION,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0.0,
        "max_tokens": 100,
    }
    direct = httpx.post(llama_jinja.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    direct_choice = direct.json()["choices"][0]
    assert direct_choice["finish_reason"] == "tool_calls"
    expected = call_parts(direct_choice["message"]["tool_calls"])
    assert expected and all(name == "get_weather" for name, _ in expected)
    assert all("city" in json.loads(str(arguments)) for _, arguments in expected)
    gateway = gateway_for([(llama_jinja.base_url, llama_jinja.model)], "llama-tools", tmp_path)
    try:
        # Its context is a slot's (its /props), not the model's training context.
        models = httpx.get(gateway.v1 + "/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 2048)]
        through = httpx.post(
            gateway.v1 + "/chat/completions", json={**body, "model": MODEL}, timeout=120
        )
        assert through.status_code == 200, through.text
        choice = through.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert call_parts(choice["message"]["tool_calls"]) == expected
        # Streamed: each call reaches the client whole, in one delta.
        port = int(gateway.base_url.rsplit(":", 1)[1])
        stream = open_stream(
            "127.0.0.1", port, "/v1/chat/completions", {**body, "model": MODEL, "stream": True}
        )
        deltas: list[dict[str, object]] = []
        finish = None
        for event in stream.events():
            if event.data == b"data: [DONE]":
                break
            assert b'"error"' not in event.data, event.data
            if event.data.startswith(b"data: {"):
                for streamed in json.loads(event.data[6:]).get("choices") or []:
                    deltas += streamed["delta"].get("tool_calls") or []
                    finish = streamed["finish_reason"] or finish
        stream.close()
        assert call_parts(deltas) == expected and finish == "tool_calls"
        assert all(json.loads(str(arguments)) for _, arguments in call_parts(deltas))
        # The second turn: the call and its result go back, an answer in text comes.
        call = choice["message"]["tool_calls"][0]
        turn = {
            **body,
            "model": MODEL,
            "tool_choice": "auto",
            "messages": [
                *WEATHER_QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'},
            ],
        }
        second = httpx.post(gateway.v1 + "/chat/completions", json=turn, timeout=120)
        assert second.status_code == 200, second.text
        # The history reached it as sent: the same answer as direct access gives.
        alone = httpx.post(
            llama_jinja.base_url + "/v1/chat/completions",
            json={**turn, "model": llama_jinja.model},
            timeout=120,
        )
        message, direct_message = (r.json()["choices"][0]["message"] for r in (second, alone))
        assert message["content"] == direct_message["content"]
    finally:
        gateway.stop()
