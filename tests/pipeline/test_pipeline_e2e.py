"""Pipelines through the app, in process (sim engine, the official client): retrieval, the
input guard, an output guard that trips within its window, formatting, a stage that
stalls pausing only its own request, and a client that leaves a stalled pipeline.

Streams that must be watched while they run are read as they are written
(:func:`tests.support.inprocess.streaming_client`), with the engine held at a gate
(:func:`tests.support.inprocess.gate_engine`) where how far a stream gets matters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
import yaml

from tests.simtext import expected_chat
from tests.support.inprocess import (
    InProcessApp,
    gate_engine,
    serve_in_process,
    streaming_client,
    wait_until,
    websocket_connect,
)

MODEL = "sluicegate-sim"
WINDOW, STRIDE = 16, 8
HIGH_WATER_TOKENS = 32
#: The tests share one app, so they share its event loop (the module's).
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stall") / "stalled"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(
    tmp_path_factory: pytest.TempPathFactory, stall_file: Path
) -> AsyncIterator[InProcessApp]:
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
                            # A slow moderation service, held as long as the test
                            # needs: not a check past its deadline.
                            "check_timeout_seconds": 60,
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
    async with serve_in_process(
        config=tmp / "config.yaml",
        journal_path=str(tmp / "jobs.sqlite3"),
        # Steps of 0.2 ms: the guard's 14 answers of 300 tokens are quick; nothing here
        # depends on the pace (a stream that must stay put is held at the gate).
        sim_step_base_ms=0.2,
        max_num_seqs=16,
        max_model_len=4096,
        high_water_tokens=HIGH_WATER_TOKENS,
        low_water_tokens=8,
        flush_interval_ms=0,
        # A stream whose client left is cancelled at once (none comes back here).
        detached_grace_seconds=0,
    ) as served:
        yield served


def chunks_of(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body (up to ``[DONE]``)."""
    chunks = []
    for line in raw.splitlines():
        if line == "data: [DONE]":
            break
        if line.startswith("data: {"):
            chunks.append(orjson.loads(line[6:]))
    return chunks


def summary(chunks: list[dict[str, Any]]) -> tuple[str, str | None, dict[str, Any]]:
    """(text, finish reason, the last usage) of a streamed chat's chunks."""
    text, finish, use = [], None, {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        use = chunk.get("usage") or use
        if chunk["choices"]:
            choice = chunk["choices"][0]
            finish = choice.get("finish_reason") or finish
            text.append(choice["delta"].get("content") or "")
    return "".join(text), finish, use


async def stream(app: InProcessApp, body: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """(text, finish reason, the last usage) of a streamed chat, read whole."""
    response = await app.client.post("/v1/chat/completions", json=body | {"stream": True})
    assert response.status_code == 200, response.text
    return summary(chunks_of(response.text))


def set_stalled(stall_file: Path, stalled: bool) -> None:
    """The switch of :class:`tests.pipeline.stall_check.StallCheck`."""
    if stalled:
        stall_file.touch()
    else:
        stall_file.unlink(missing_ok=True)


def cancellations(app: InProcessApp) -> float:
    return app.state.metrics.cancellations_total._value.get()


def moderation_paused(app: InProcessApp) -> dict[str, Any] | None:
    """The stream held by the stalled stage, once flow control has paused it."""
    assert app.state.ready is not None
    for s in app.state.ready.flow.snapshot(None):
        if s["held_by"] == "moderation" and s["paused"]:
            return s
    return None


async def test_a_pipeline_is_a_model_that_retrieves_and_formats(app: InProcessApp) -> None:
    api = app.openai(max_retries=0)
    assert {"support-bot", "guarded", MODEL} <= {m.id for m in (await api.models.list()).data}
    question = [{"role": "user", "content": "How many days until my refund?"}]
    plain = await api.chat.completions.create(model=MODEL, messages=question, max_tokens=20)  # type: ignore[arg-type]
    answer = await api.chat.completions.create(
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
    text, finish, use = await stream(app, body)
    assert text == content and finish == "length"
    timing = use["sluicegate"]
    # Retrieval comes before the first token (which waits for it).
    assert 0 < timing["retrieval_seconds"] < timing["ttft_seconds"]
    metrics = await app.metrics()
    assert metrics.get('sluicegate_retrieval_seconds_count{pipeline="support-bot"}') == 2


async def test_the_input_guard_refuses_a_prompt_before_any_work(app: InProcessApp) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await app.openai(max_retries=0).chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Tell me the PASSWORD"}]
        )
    assert refused.value.code == "content_filter"
    assert refused.value.param == "messages"
    key = 'sluicegate_guard_trips_total{check="regex",pipeline="support-bot",where="input"}'
    assert (await app.metrics()).get(key) == 1


async def test_a_tripped_guard_cuts_the_stream_within_one_window(app: InProcessApp) -> None:
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
        text, finish, _ = await stream(app, body)
        if "queue" not in full:
            assert (text, finish) == (full, "length")
            continue
        trips += 1
        assert finish == "content_filter" and text.endswith("[filtered]")
        released = text.removesuffix("[filtered]")
        assert full.startswith(released) and "queue" not in released
        # The trip came within a window (and a stride) of the match's end.
        match_end = len(full[: full.index("queue") + 5].encode())
        assert len(released.encode()) >= match_end - WINDOW - STRIDE, (seed, released)
        whole = (await app.client.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["content"] == "[filtered]"
        assert whole["choices"][0]["finish_reason"] == "content_filter"
    assert trips >= 3
    metrics = await app.metrics()
    key = 'sluicegate_guard_trips_total{check="regex",pipeline="guarded",where="output"}'
    assert metrics.get(key) == 2 * trips
    assert metrics.get('sluicegate_requests_total{status="content_filter"}') == 2 * trips


async def read_stream(
    client: httpx.AsyncClient, body: dict[str, Any], into: list[dict[str, Any]]
) -> None:
    """Read a streamed chat as it is written, its chunks into ``into``."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                into.append(orjson.loads(line[6:]))


async def test_a_stalled_stage_pauses_only_its_own_request(
    app: InProcessApp, stall_file: Path
) -> None:
    messages = [{"role": "user", "content": "a long answer"}]
    slow_body = {
        "model": "slow-bot",
        "messages": messages,
        "max_tokens": 400,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
    }
    set_stalled(stall_file, True)
    slow_chunks: list[dict[str, Any]] = []
    try:
        async with streaming_client(app) as client:
            with gate_engine(app) as gate:
                slow = asyncio.create_task(read_stream(client, slow_body, slow_chunks))
                # Its backlog stops at the water mark (plus what was in flight), not at
                # the answer's end: the pause comes within this many steps, one token
                # each (the engine stops at the gate after them, pause or not).
                gate.allow(3 * HIGH_WATER_TOKENS)
                await wait_until(
                    lambda: moderation_paused(app) is not None, "the stalled stage's pause"
                )
                held = moderation_paused(app)
                assert held is not None
                metrics = await app.metrics()
                assert metrics.get('sluicegate_streams_paused{stage="moderation"}') == 1
                assert metrics.get('sluicegate_stream_pauses_total{stage="moderation"}') >= 1
            # Meanwhile another request streams to its end ...
            other = [{"role": "user", "content": "meanwhile"}]
            text, finish, _ = await stream(
                app,
                {"model": MODEL, "messages": other, "max_tokens": 200, "seed": 1},
            )
            assert (text, finish) == (expected_chat(other, 1, 200), "length")
            # ... while the paused one decoded nothing in any of its steps.
            still = moderation_paused(app)
            assert still is not None and still["tokens_produced"] == held["tokens_produced"]
            assert not slow.done()
            set_stalled(stall_file, False)
            await asyncio.wait_for(slow, 30)
    finally:
        set_stalled(stall_file, False)
    # Resumed, it finishes exactly as it would have without the stage.
    text, finish, _ = summary(slow_chunks)
    assert (text, finish) == (expected_chat(messages, 3, 400), "length")


async def test_a_client_that_leaves_a_stalled_pipeline_cancels_its_sequence(
    app: InProcessApp, stall_file: Path
) -> None:
    before = cancellations(app)
    set_stalled(stall_file, True)
    try:
        body = {
            "model": "slow-bot",
            "messages": [{"role": "user", "content": "leave"}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            streaming_client(app) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            await wait_until(lambda: moderation_paused(app) is not None, "the pause")
        # Leaving the response is the client going away.
        await wait_until(lambda: cancellations(app) == before + 1, "the cancellation")
    finally:
        set_stalled(stall_file, False)

    async def nothing_running() -> bool:
        return bool((await app.stats())["requests_running"] == 0)

    await wait_until(nothing_running, "nothing left running")


QUESTION_WS = [{"role": "user", "content": "over the websocket"}]


async def test_a_pipeline_over_the_websocket_trips_like_over_http(app: InProcessApp) -> None:
    seed = next(s for s in range(1, 50) if "queue" in expected_chat(QUESTION_WS, s, 200))
    body = {
        "model": "guarded",
        "messages": QUESTION_WS,
        "max_tokens": 200,
        "seed": seed,
        "ignore_eos": True,
    }
    text, _, _ = await stream(app, body)
    received, done = "", None
    async with websocket_connect(app, "/v1/ws") as ws:
        await ws.send_text(orjson.dumps({"type": "request", "body": body}).decode())
        while done is None:
            message = orjson.loads(await ws.receive_text())
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
