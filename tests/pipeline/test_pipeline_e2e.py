"""Pipelines through the real server (sim engine, real sockets, the official client):
retrieval, the input guard, an output guard that trips within its window, formatting,
and a stage that stalls pausing only its own request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from sluicegate.bench.raw_client import event_text, open_stream
from tests.simtext import expected_chat
from tests.support.servers import ServerProcess, cancellations, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
WINDOW, STRIDE = 16, 8


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stall") / "stalled"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stall_file: Path) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pipelines")
    kb = tmp / "kb"
    kb.mkdir()
    (kb / "refunds.md").write_text("# Refunds\n\nItems can be returned within 30 days.\n")
    (kb / "shipping.md").write_text("# Shipping\n\nParcels arrive in 3 to 5 business days.\n")
    regex = {"type": "regex", "patterns": ["queue"]}
    config = {
        "pipelines": [
            {
                "name": "support-bot",
                "system_prompt": "You are a support agent.",
                "retrieve": {"documents": str(kb), "top_k": 1},
                "input_guard": {"checks": [{"type": "regex", "patterns": ["(?i)password"]}]},
                "stages": [{"format": {"prefix": "> ", "citations": True}}],
            },
            {
                "name": "guarded",
                "stages": [
                    {
                        "guard": {
                            "window_tokens": WINDOW,
                            "stride_tokens": STRIDE,
                            "replacement": "[filtered]",
                            "checks": [regex],
                        }
                    }
                ],
            },
            {
                "name": "slow-bot",
                "channel_tokens": 8,
                "stages": [
                    {
                        "guard": {
                            "name": "moderation",
                            "window_tokens": 8,
                            "stride_tokens": 4,
                            "checks": [
                                {
                                    "type": "tests.pipeline.stall_check:StallCheck",
                                    "options": {"path": str(stall_file)},
                                }
                            ],
                        }
                    }
                ],
            },
        ]
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    args = [
        "--config",
        str(tmp / "config.yaml"),
        "--engine",
        "sim",
        "--sim-step-base-ms",
        "1",
        "--sim-step-per-token-ms",
        "0.01",
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "4096",
        "--high-water-tokens",
        "32",
        "--low-water-tokens",
        "8",
        "--flush-interval-ms",
        "0",
    ]
    process = start_server(args, "pipelines")
    yield process
    process.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


def stream(server: ServerProcess, body: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """(text, finish reason, the last usage) of a streamed chat."""
    port = int(server.base_url.rsplit(":", 1)[1])
    raw = open_stream("127.0.0.1", port, "/v1/chat/completions", body | {"stream": True})
    text, finish, use = [], None, {}
    for event in raw.events():
        if event.data == b"data: [DONE]":
            break
        if event.data.startswith(b"data: {"):
            chunk = orjson.loads(event.data[6:])
            assert "error" not in chunk, chunk
            use = chunk.get("usage") or use
            if chunk["choices"]:
                finish = chunk["choices"][0].get("finish_reason") or finish
        if (piece := event_text(event)) is not None:
            text.append(piece)
    raw.close()
    return "".join(text), finish, use


def test_a_pipeline_is_a_model_that_retrieves_and_formats(server: ServerProcess) -> None:
    with client(server) as api:
        assert {"support-bot", "guarded", MODEL} <= {m.id for m in api.models.list().data}
        question = [{"role": "user", "content": "How many days until my refund?"}]
        plain = api.chat.completions.create(model=MODEL, messages=question, max_tokens=20)  # type: ignore[arg-type]
        answer = api.chat.completions.create(
            model="support-bot",
            messages=question,
            max_tokens=20,
            seed=7,  # type: ignore[arg-type]
        )
    assert answer.model == "support-bot"
    content = answer.choices[0].message.content or ""
    assert content.startswith("> ") and content.endswith("\n\nSources: refunds.md")
    # The system prompt and the retrieved passage are in the prompt.
    assert answer.usage is not None and plain.usage is not None
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    body = {
        "model": "support-bot",
        "messages": question,
        "max_tokens": 20,
        "seed": 7,
        "stream_options": {"include_usage": True},
    }
    text, finish, use = stream(server, body)
    assert text == content and finish == "length"
    timing = use["sluicegate"]
    assert 0 < timing["retrieval_seconds"] < timing["ttft_seconds"]
    metrics = server.metrics()
    assert metrics.get('sluicegate_retrieval_seconds_count{pipeline="support-bot"}') == 2


def test_the_input_guard_refuses_a_prompt_before_any_work(server: ServerProcess) -> None:
    with client(server) as api, pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Tell me the PASSWORD"}]
        )
    assert refused.value.code == "content_filter"
    assert refused.value.param == "messages"
    key = 'sluicegate_guard_trips_total{check="regex",pipeline="support-bot",where="input"}'
    assert server.metrics().get(key) == 1


def test_a_tripped_guard_cuts_the_stream_within_one_window(server: ServerProcess) -> None:
    trips = 0
    for seed in range(1, 8):
        messages = [{"role": "user", "content": f"Tell me a story {seed}"}]
        full = expected_chat(messages, seed, 300)
        body = {
            "model": "guarded",
            "messages": messages,
            "max_tokens": 300,
            "seed": seed,
            "ignore_eos": True,
        }
        text, finish, _ = stream(server, body)
        if "queue" not in full:
            assert (text, finish) == (full, "length")
            continue
        trips += 1
        assert finish == "content_filter" and text.endswith("[filtered]")
        released = text.removesuffix("[filtered]")
        assert full.startswith(released) and "queue" not in released
        # The trip came within a window (and a stride) of the match's end.
        match_end = len(full[: full.index("queue") + 5].encode())
        assert len(released.encode()) >= match_end - WINDOW - STRIDE
        whole = httpx.post(server.v1 + "/chat/completions", json=body, timeout=30).json()
        assert whole["choices"][0]["message"]["content"] == "[filtered]"
        assert whole["choices"][0]["finish_reason"] == "content_filter"
    assert trips >= 3
    metrics = server.metrics()
    key = 'sluicegate_guard_trips_total{check="regex",pipeline="guarded",where="output"}'
    assert metrics.get(key) == 2 * trips
    assert metrics.get('sluicegate_requests_total{status="content_filter"}') == 2 * trips


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_stalled_stage_pauses_only_its_own_request(
    server: ServerProcess, stall_file: Path
) -> None:
    messages = [{"role": "user", "content": "a long answer"}]
    slow_body = {
        "model": "slow-bot",
        "messages": messages,
        "max_tokens": 400,
        "seed": 3,
        "ignore_eos": True,
    }
    stall_file.touch()
    result: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: result.update(out=stream(server, slow_body)))
    slow.start()
    try:

        def paused_by_moderation() -> dict[str, Any] | None:
            for s in server.stats()["streams"]:
                if s["held_by"] == "moderation" and s["paused"]:
                    return s
            return None

        held = wait_for(paused_by_moderation, 10, "the stalled stage's pause")
        # Its backlog stops at the water mark (plus what was in flight), not the answer.
        assert held["tokens_produced"] < 100
        metrics = server.metrics()
        assert metrics.get('sluicegate_streams_paused{stage="moderation"}') == 1
        assert metrics.get('sluicegate_stream_pauses_total{stage="moderation"}') >= 1
        # Meanwhile another request streams to its end.
        other = [{"role": "user", "content": "meanwhile"}]
        text, finish, _ = stream(
            server,
            {"model": MODEL, "messages": other, "max_tokens": 200, "seed": 1, "ignore_eos": True},
        )
        assert (text, finish) == (expected_chat(other, 1, 200), "length")
        assert slow.is_alive()
    finally:
        stall_file.unlink()
    slow.join(30)
    # Resumed, it finishes exactly as it would have without the stage.
    assert result["out"][:2] == (expected_chat(messages, 3, 400), "length")


def test_a_client_that_leaves_a_stalled_pipeline_cancels_its_sequence(
    server: ServerProcess, stall_file: Path
) -> None:
    before = cancellations(server)
    stall_file.touch()
    try:
        port = int(server.base_url.rsplit(":", 1)[1])
        body = {
            "model": "slow-bot",
            "messages": [{"role": "user", "content": "leave"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        raw = open_stream("127.0.0.1", port, "/v1/chat/completions", body)
        wait_for(lambda: server.stats()["streams_paused"] == 1, 10, "the pause")
        raw.close()
        wait_for(lambda: cancellations(server) == before + 1, 10, "the cancellation")
    finally:
        stall_file.unlink()
    wait_for(lambda: server.stats()["requests_running"] == 0, 10, "nothing left running")


def test_a_pipeline_over_the_websocket_trips_like_over_http(server: ServerProcess) -> None:
    from websockets.sync.client import connect

    seed = next(s for s in range(1, 50) if "queue" in expected_chat(QUESTION_WS, s, 200))
    body = {
        "model": "guarded",
        "messages": QUESTION_WS,
        "max_tokens": 200,
        "seed": seed,
        "ignore_eos": True,
    }
    text, _, _ = stream(server, body)
    url = server.base_url.replace("http://", "ws://") + "/v1/ws"
    received, done = "", None
    with connect(url) as ws:
        ws.send(orjson.dumps({"type": "request", "body": body}).decode())
        while done is None:
            message = orjson.loads(ws.recv(timeout=10))
            if message.get("object") == "chat.completion.chunk":
                # As over SSE: the role, the text, then the finish reason's own chunk.
                assert message["model"] == "guarded"
                received += message["choices"][0]["delta"].get("content") or ""
            elif message.get("type") == "done":
                done = message
            else:
                raise AssertionError(message)
    assert done["finish_reason"] == "content_filter"
    assert received == text and received.endswith("[filtered]")


QUESTION_WS = [{"role": "user", "content": "over the websocket"}]
