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
from typing import Any

import httpx
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support.servers import ServerProcess, start_server
from tests.upstream.conftest import PAUSE
from tests.upstream.test_peers import MODEL, QUESTION, Peer, gateway_args, stream_text

pytestmark = pytest.mark.slow


def gateway_for(peers: list[tuple[str, str]], name: str, tmp: Path, *extra: str) -> ServerProcess:
    """A gateway serving ``MODEL`` from ``peers`` (url, the peer's own model name)."""
    return start_server([*gateway_args(peers, tmp / "gateway.yaml"), *extra], f"gateway-{name}")


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
    peer.wait()
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
        # Its four slots (-np 4, its /props total_slots) are the most it is given.
        assert upstream["limit"] == 4
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
            # A slot holds 1,024 tokens (-c 4096 over -np 4), and the gateway reads that
            # from llama-server's /props: more would be a 400 context_length_exceeded.
            "max_tokens": 900,
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
        # Its own counter falls to 0 at once, not after 900 tokens (~9 s).
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
        *PAUSE,
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


#: A chat template that describes tools (Qwen 2.5's: ChatML, as SmolLM2's own, plus tools
#: and ``<tool_call>`` turns), from the llama.cpp tree the binary was built in.
TOOLS_TEMPLATE = (
    Path(BINARY).resolve().parents[2] / "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"
)


@pytest.fixture(scope="module")
def llama_jinja() -> Iterator[Peer]:
    """llama-server with ``--jinja`` and a template that renders tools (SmolLM2's own has
    none, and llama.cpp's current chat code no longer describes tools for such a template).
    Two slots of 2,048 tokens each."""
    from sluicegate.engine.torch import default_model_path

    if not TOOLS_TEMPLATE.is_file():
        pytest.skip(f"no {TOOLS_TEMPLATE.name} beside the binary (its llama.cpp source tree)")
    gguf = default_model_path()
    args = [str(BINARY), "-m", gguf, "-t", "2", "-np", "2", "-c", "4096", "--jinja"]
    args += ["--chat-template-file", str(TOOLS_TEMPLATE)]
    peer = Peer("llama-server-jinja", args, {}, model=Path(gguf).name)
    peer.wait()
    yield peer
    peer.stop()


def answer_parts(message: dict[str, Any]) -> tuple[object, list[tuple[object, object]]]:
    """The text and the (name, arguments) of each call: ids are the engine's own random
    ones."""
    calls = message.get("tool_calls") or []
    return message.get("content") or "", [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


def streamed_parts(
    gateway: ServerProcess, body: dict[str, object]
) -> tuple[tuple[object, list[tuple[object, object]]], str | None]:
    """A streamed answer through the gateway, assembled as a client does."""
    port = int(gateway.base_url.rsplit(":", 1)[1])
    stream = open_stream("127.0.0.1", port, "/v1/chat/completions", {**body, "stream": True})
    text: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    try:
        for event in stream.events():
            if event.data == b"data: [DONE]":
                break
            assert b'"error"' not in event.data, event.data
            if event.data.startswith(b"data: {"):
                for choice in json.loads(event.data[6:]).get("choices") or []:
                    text.append(choice["delta"].get("content") or "")
                    for delta in choice["delta"].get("tool_calls") or []:
                        call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                        function = delta.get("function") or {}
                        call["name"] += function.get("name") or ""
                        call["arguments"] += function.get("arguments") or ""
                    finish = choice["finish_reason"] or finish
    finally:
        stream.close()
    parts = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return ("".join(text), parts), finish


def test_tools_pass_through_to_llama_server(llama_jinja: Peer, tmp_path: Path) -> None:
    """``tools``, ``tool_choice`` and a tool-calling history reach llama-server as sent:
    through the gateway, greedy answers are the ones llama-server gives directly, streamed
    and not, whatever it makes of them (this llama.cpp does not hold SmolLM2 to a call
    under ``required``: it may answer in text)."""
    body: dict[str, object] = {
        "model": llama_jinja.model,
        "messages": WEATHER_QUESTION,
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0.0,
        "max_tokens": 60,
        # llama.cpp's own field (passed through): each answer computes its whole prompt,
        # so that a reused prompt cache does not move a greedy answer's near ties.
        "cache_prompt": False,
    }
    direct = httpx.post(llama_jinja.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    direct_choice = direct.json()["choices"][0]
    # The tools were rendered into its prompt (the question alone is ~37 tokens).
    assert direct.json()["usage"]["prompt_tokens"] > 100
    expected = answer_parts(direct_choice["message"])
    gateway = gateway_for([(llama_jinja.base_url, llama_jinja.model)], "llama-tools", tmp_path)
    try:
        # Its context is a slot's (its /props), not the model's training context.
        models = httpx.get(gateway.v1 + "/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [
            (MODEL, 2048),
            (EMBEDDING_MODEL, 8192),
        ]
        ours = {**body, "model": MODEL}
        through = httpx.post(gateway.v1 + "/chat/completions", json=ours, timeout=120)
        assert through.status_code == 200, through.text
        choice = through.json()["choices"][0]
        assert answer_parts(choice["message"]) == expected
        assert choice["finish_reason"] == direct_choice["finish_reason"]
        assert streamed_parts(gateway, ours) == (expected, direct_choice["finish_reason"])
        # A second turn with a call and its result: the history reaches it as sent.
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
        turn = {
            **ours,
            "tool_choice": "auto",
            "messages": [
                *WEATHER_QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
            ],
        }
        second = httpx.post(gateway.v1 + "/chat/completions", json=turn, timeout=120)
        assert second.status_code == 200, second.text
        alone = httpx.post(
            llama_jinja.base_url + "/v1/chat/completions",
            json={**turn, "model": llama_jinja.model},
            timeout=120,
        )
        assert alone.status_code == 200, alone.text
        message, direct_message = (r.json()["choices"][0]["message"] for r in (second, alone))
        assert answer_parts(message) == answer_parts(direct_message)
        assert alone.json()["usage"]["prompt_tokens"] > direct.json()["usage"]["prompt_tokens"]
    finally:
        gateway.stop()


def test_bench_upstream_fronts_a_fresh_llama_server_for_each_run(tmp_path: Path) -> None:
    """``sluicegate bench upstream --llama-server``: the same schedule at llama-server
    directly, then through a gateway in front of another one; every request answered or
    refused, none failed."""
    from sluicegate.bench.scenario import load_scenario
    from sluicegate.bench.upstream import LlamaServer, run_upstream_compare

    results, _, outputs = run_upstream_compare(
        load_scenario("upstream-1x"),
        None,
        tmp_path,
        llama_server=LlamaServer(str(BINARY), slots=2),
        duration_seconds=3.0,
        capacity_rps=1.0,
        show_progress=False,
    )
    assert [r.label for r in results] == ["direct", "gateway"]
    for result in results:
        summary = result.summary()["all"]
        assert summary.num_completed > 0 and summary.num_errors == 0
        assert summary.num_completed + summary.num_rejected == summary.num_sent
    assert (tmp_path / "llama-server-direct.log").exists()
    assert outputs.summary_md.exists()
