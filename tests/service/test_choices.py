"""``n`` choices on the embedded core: one sequence per choice, one stream, one log.

In process on the sim (its answer is a pure function of the prompt and the seed, so
choice ``i`` of a request seeded ``s`` must be exactly the answer of one choice seeded
``s + i``), through the official ``openai`` client and raw HTTP; and once on SmolLM2
through a real server (the session's, :mod:`tests.support.model_server`): the choices
equal the single answers of their seeds, and the choices after the first reuse the first
one's prefill.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from sluicegate.engine.embedded import EmbeddedCore
from sluicegate.engine.output import RequestStream
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.step import StepPlan, StepResult
from sluicegate.service.choices import choice_seed
from sluicegate.stream.flow import StreamFlow
from tests.support.inprocess import (
    InProcessApp,
    gate_engine,
    serve_in_process,
    streaming_client,
    wait_until,
    websocket_connect,
)
from tests.support.model_server import TEST_TIMEOUT_SECONDS
from tests.support.servers import ServerProcess

MODEL = "sluicegate-sim"
TOKEN_HEADER = "x-sluicegate-resume-token"
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are the tide table of a small harbour."},
    {"role": "user", "content": "When is high water tomorrow morning?"},
]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "seed": 7, **fields}


def cached_tokens(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def data_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON objects of an SSE body, in order (chunks and error events)."""
    return [orjson.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


def by_choice(chunks: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, list[str]]]:
    """(each choice's text, the finish reasons each choice's chunks carried)."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            index = choice["index"]
            texts[index] = texts.get(index, "") + (choice["delta"].get("content") or "")
            if choice["finish_reason"] is not None:
                finishes.setdefault(index, []).append(choice["finish_reason"])
    return texts, finishes


async def settled(app: InProcessApp) -> bool:
    """Nothing is left running, waiting, reserved or live (every seat given back)."""
    stats = await app.stats()
    core = app.service.core
    return (
        stats["requests_running"] == 0
        and stats["requests_waiting"] == 0
        and stats["kv_cache"]["used_blocks"] == 0
        and stats["live_requests"] == 0
        and core.capacity.num_holding == 0
        and not app.service.generations
    )


async def test_n_choices_are_the_answers_of_their_seeds_with_usage_summed() -> None:
    async with serve_in_process(admission="static") as app:
        client = app.openai(max_retries=0)
        reply = await client.chat.completions.create(**chat(n=3))
        assert [c.index for c in reply.choices] == [0, 1, 2]
        texts = [c.message.content or "" for c in reply.choices]
        assert len(set(texts)) == 3  # each choice has a seed of its own
        assert all(c.finish_reason == "length" for c in reply.choices)
        assert all(c.message.role == "assistant" for c in reply.choices)
        for index, text in enumerate(texts):
            single = await client.chat.completions.create(**chat(seed=7 + index))
            assert single.choices[0].message.content == text
            assert reply.usage is not None and single.usage is not None
            assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 3 * 16
        # The choices after the first reused its prefill (the sim's prompt is its bytes).
        details = reply.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == reply.usage.prompt_tokens - 1
        # Completions too, in their legacy shape.
        completion = await client.completions.create(
            model=MODEL, prompt="The tide comes in", max_tokens=8, n=2, seed=3
        )
        assert [c.index for c in completion.choices] == [0, 1]
        assert completion.choices[0].text != completion.choices[1].text
        assert completion.usage is not None and completion.usage.completion_tokens == 16
        await wait_until(lambda: settled(app), "every seat given back")


async def test_a_stream_of_n_choices_tags_each_delta_and_ends_each_choice_once() -> None:
    async with serve_in_process(admission="static") as app:
        client = app.openai(max_retries=0)
        whole = await client.chat.completions.create(**chat(n=3))
        stream = await client.chat.completions.create(
            **chat(n=3), stream=True, stream_options={"include_usage": True}
        )
        texts: dict[int, str] = {}
        roles: dict[int, str | None] = {}
        finishes: dict[int, list[str]] = {}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                roles.setdefault(choice.index, choice.delta.role)
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason is not None:
                    finishes.setdefault(choice.index, []).append(choice.finish_reason)
        assert texts == {c.index: c.message.content for c in whole.choices}
        assert roles == dict.fromkeys(range(3), "assistant")  # each choice opens with its role
        assert finishes == {index: ["length"] for index in range(3)}
        assert usage is not None and usage.completion_tokens == 48
        assert whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
        # The openai client's own stream helper assembles the same choices.
        async with client.chat.completions.stream(**chat(n=3)) as helper:
            async for _ in helper:
                pass
            with pytest.raises(openai.LengthFinishReasonError) as info:
                await helper.get_final_completion()
        assembled = info.value.completion.choices
        assert [(c.message.role, c.message.content) for c in assembled] == [
            ("assistant", texts[i]) for i in range(3)
        ]


async def test_n_beyond_the_limit_or_the_engine_is_refused_with_a_400() -> None:
    async with serve_in_process(
        admission="static", max_num_seqs=4, max_model_len=512, num_kv_blocks=64
    ) as app:
        client = app.openai(max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**chat(n=9))
        assert info.value.param == "n" and "between 1 and 8" in info.value.message
        # Five sequences can never run at once on four seats: refused, not queued forever.
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**chat(n=5))
        assert info.value.param == "n" and "max_num_seqs" in info.value.message
        # Three choices of up to 400 tokens need more KV (3 x 26 blocks) than the 64 blocks.
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**chat(n=3, max_tokens=400))
        assert info.value.param == "n" and "KV cache" in info.value.message
        fits = await client.chat.completions.create(**chat(n=4, max_tokens=100))
        assert len(fits.choices) == 4
        await wait_until(lambda: settled(app), "every seat given back")


async def test_rate_limits_charge_every_choice_its_max_tokens() -> None:
    # 600 tokens a minute: nothing refills in the test's time.
    tenants = [{"name": "t", "api_key": "k", "tokens_per_minute": 600}]
    async with serve_in_process(admission="static", tenants=tenants) as app:
        client = app.openai(api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(**chat(n=4, max_tokens=200))  # 800 + prompt
        assert info.value.code == "request_too_large"
        # Two choices of 200 (400 + the prompt, charged and used): one choice of 200 more
        # no longer fits, where it would after one choice of 200.
        first = await client.chat.completions.create(**chat(n=2, max_tokens=200))
        assert first.usage is not None and first.usage.completion_tokens == 400
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(**chat(max_tokens=200))


async def test_cancelling_n_choices_frees_every_seat() -> None:
    async with serve_in_process(admission="static") as app, streaming_client(app) as http:
        with gate_engine(app) as gate:
            async with http.stream(
                "POST", "/v1/chat/completions", json=chat(n=4, max_tokens=500, stream=True)
            ) as response:
                rid = response.headers["x-request-id"]
                # Choice 0 first; the others once its prompt is computed.
                await gate.step_until(lambda: len(gate.first_run) == 4, "all four choices run")
                assert gate.first_run == [rid, f"{rid}#1", f"{rid}#2", f"{rid}#3"]
                assert (await app.stats())["requests_running"] == 4
                token = {TOKEN_HEADER: response.headers[TOKEN_HEADER]}  # open mode
                cancel = await app.client.post(f"/v1/requests/{rid}/cancel", headers=token)
                assert cancel.status_code == 200, cancel.text
                gate.open()
                body = (await response.aread()).decode()
        await wait_until(lambda: settled(app), "every seat given back")
        texts, _ = by_choice(data_chunks(body))
        assert set(texts) == {0, 1, 2, 3}
        assert all(len(t.encode()) < 500 for t in texts.values())  # cut short


async def test_cancelling_before_the_other_choices_start_gives_back_their_seats() -> None:
    async with serve_in_process(admission="static") as app:
        with gate_engine(app) as gate:
            task = asyncio.create_task(app.client.post("/v1/chat/completions", json=chat(n=3)))
            # Dispatched: three seats reserved, choice 0 handed to the engine, not run yet.
            await wait_until(lambda: app.service.core.capacity.num_holding == 3, "dispatched")
            (generation,) = app.service.generations.values()
            app.service.cancel(generation)
            gate.open()
            response = await task
        await wait_until(lambda: settled(app), "every seat given back")
        assert set(gate.first_run) <= {generation.request_id}  # the others never ran
        assert response.status_code == 200  # cancelled by another party: what there was


async def test_pausing_n_choices_pauses_each_until_resumed() -> None:
    # 300 tokens at 5 ms a step: the answer runs for seconds, the checks take milliseconds.
    async with serve_in_process(admission="static", sim_step_base_ms=5.0) as app:
        service = app.service
        body = chat(n=3, max_tokens=300)
        task = asyncio.create_task(app.client.post("/v1/chat/completions", json=body))
        await wait_until(lambda: service.core.stats().num_running == 3, "three choices run")
        (generation,) = service.generations.values()
        service.pause(generation.request_id)
        await wait_until(lambda: service.core.stats().num_paused == 3, "all three paused")
        assert not task.done()
        service.resume(generation.request_id)
        response = await task
        assert [c["finish_reason"] for c in response.json()["choices"]] == ["length"] * 3


async def test_an_engine_failure_ends_the_answer_with_its_error() -> None:
    async with serve_in_process(admission="static") as app:
        core = app.service.core
        assert isinstance(core, EmbeddedCore)
        step = core.engine.step

        def failing_step(plan: StepPlan) -> StepResult:  # the engine thread
            if any(s.request_id.endswith("#2") and s.output_index >= 3 for s in plan.sequences):
                raise RuntimeError("the device fell over")
            return step(plan)

        core.engine.step = failing_step  # type: ignore[method-assign]
        response = await app.client.post("/v1/chat/completions", json=chat(n=3))
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_error" and "engine step failed" in error["message"]
        await wait_until(lambda: settled(app), "every seat given back")


def test_a_stream_of_choices_is_paused_while_any_choice_is() -> None:
    # Choice 0 may end first: its sequence is no longer paused, the others still are.
    sampling = SamplingParams(max_tokens=4, seed=1)
    first, second = Request("a", [1], sampling), Request("a#1", [1], sampling)
    flow = StreamFlow(RequestStream("a"), first, siblings=(second,))
    assert not flow.paused
    second.pause.begin(0.0)
    assert flow.paused
    second.pause.end(1.0)
    assert not flow.paused


def test_choice_seeds_stay_64_bit() -> None:
    assert choice_seed(5, 2) == 7
    assert choice_seed(2**63 - 1, 1) == -(2**63)
    assert choice_seed(-1, 1) == 0


async def test_a_background_job_keeps_its_n_choices(tmp_path: Path) -> None:
    async with serve_in_process(admission="static", journal_path=str(tmp_path / "j.db")) as app:
        submitted = await app.client.post("/v1/chat/completions", json=chat(n=2, background=True))
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]

        async def done() -> bool:
            view = (await app.client.get(f"/v1/jobs/{job_id}")).json()
            assert view["status"] != "failed", view
            return bool(view["status"] == "done")

        await wait_until(done, "the job ran")
        result = (await app.client.get(f"/v1/jobs/{job_id}")).json()["result"]
        direct = (await app.client.post("/v1/chat/completions", json=chat(n=2))).json()
        assert result["choices"] == direct["choices"] and len(result["choices"]) == 2


async def test_n_choices_over_a_websocket_with_little_credit() -> None:
    """Credit for a few tokens at a time: the choices pause and resume together, and
    each arrives whole, tagged with its index."""
    async with serve_in_process(admission="static") as app:
        whole = (await app.client.post("/v1/chat/completions", json=chat(n=2))).json()
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        done: dict[str, Any] | None = None
        async with websocket_connect(app, "/v1/ws") as ws:
            request = {"type": "request", "body": chat(n=2), "credits": 4}
            await ws.send_text(orjson.dumps(request).decode())
            while done is None:
                message = orjson.loads(await ws.receive_text())
                if message.get("type") == "done":
                    done = message
                    continue
                assert message.get("object") == "chat.completion.chunk", message
                for choice in message["choices"]:
                    index = choice["index"]
                    texts[index] = texts.get(index, "") + (choice["delta"].get("content") or "")
                    if choice["finish_reason"] is not None:
                        finishes[index] = choice["finish_reason"]
                await ws.send_text(orjson.dumps({"type": "credit", "tokens": 4}).decode())
        assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
        assert finishes == {0: "length", 1: "length"}
        assert done["usage"]["completion_tokens"] == 32
        await wait_until(lambda: settled(app), "every seat given back")


async def test_a_finished_stream_of_choices_replays_identically() -> None:
    async with serve_in_process(admission="static") as app:
        response = await app.client.post(
            "/v1/chat/completions",
            json=chat(n=3, stream=True, stream_options={"include_usage": True}),
        )
        assert response.status_code == 200, response.text
        rid = response.headers["x-sluicegate-stream-id"]
        token = {TOKEN_HEADER: response.headers[TOKEN_HEADER]}  # open mode
        replay = await app.client.get(f"/v1/streams/{rid}", headers=token)
        assert replay.status_code == 200, replay.text
        assert replay.text == response.text
        texts, finishes = by_choice(data_chunks(replay.text))
        assert set(texts) == {0, 1, 2} and finishes == {index: ["length"] for index in range(3)}


async def read_then_leave(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    num_events: int,
    enough: asyncio.Event,
    leave: asyncio.Event,
) -> tuple[httpx.Headers, list[str]]:
    """(response headers, the data lines read) of a stream whose client reads
    ``num_events`` events, says so (``enough``) and leaves when told (``leave``)."""
    lines: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        headers = response.headers
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                lines.append(line)
            if len(lines) >= num_events:
                enough.set()
                await leave.wait()
                break
    return headers, lines


async def test_a_stream_of_choices_stopped_midway_ends_with_an_error_to_retry() -> None:
    """Its replica gave it up (here: its client left, and the detach grace is 0): a
    stream of several choices is not continued; resuming it replays what was logged,
    then says to send the request again, and so does every later resume."""
    async with (
        serve_in_process(admission="static", detached_grace_seconds=0, flush_interval_ms=0) as app,
        streaming_client(app) as http,
    ):
        ready = app.state.ready
        assert ready is not None
        with gate_engine(app) as gate:
            body = chat(n=2, max_tokens=400, stream=True)
            enough, leave = asyncio.Event(), asyncio.Event()
            reading = asyncio.create_task(read_then_leave(http, body, 4, enough, leave))
            await gate.step_until(enough.is_set, "four events")
            leave.set()  # the client leaves while the engine is held
            headers, received = await reading
            rid = headers["x-sluicegate-stream-id"]
            token = {TOKEN_HEADER: headers[TOKEN_HEADER]}  # open mode
            session = ready.sessions.get(rid)
            await wait_until(
                lambda: session is None or session.stop_reason is not None, "stream stopped"
            )
        await wait_until(lambda: ready.sessions.get(rid) is None, "stream given up")
        resumed = await app.client.get(f"/v1/streams/{rid}", headers=token)
        assert resumed.status_code == 200, resumed.text
        chunks = data_chunks(resumed.text)
        assert chunks[-1]["error"]["code"] == "choices_not_resumable"
        assert "Send the request again" in chunks[-1]["error"]["message"]
        assert resumed.text.endswith("data: [DONE]\n\n")
        replayed = [s for s in resumed.text.splitlines() if s.startswith("data: {")]
        assert replayed[: len(received)] == received
        again = await app.client.get(f"/v1/streams/{rid}", headers=token)
        assert again.text == resumed.text
        await wait_until(lambda: settled(app), "every seat given back")


# --------------------------------------------------------------------------------------
# SmolLM2 through a real server


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.timeout(TEST_TIMEOUT_SECONDS)
def test_smollm2_choices_equal_single_answers_and_share_the_prefill(
    model_server: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=model_server.v1, api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "Name a colour and say why you like it."}]
    asked: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct",
        "messages": question,
        "max_tokens": 12,
        "temperature": 0.9,
    }
    reply = client.chat.completions.create(**asked, n=4, seed=1234)
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    prompt = reply.usage.prompt_tokens
    # Choices 1-3 reused choice 0's prompt (all of it but the last token, which gives
    # the logits) instead of computing it again.
    assert reply.usage.prompt_tokens_details.cached_tokens == prompt - 1
    # The single answers at once (seeded sampling is batch-invariant): a step of four
    # sequences costs about what a step of one does.
    with ThreadPoolExecutor(len(texts)) as pool:
        singles = list(
            pool.map(
                lambda index: client.chat.completions.create(**asked, seed=1234 + index),
                range(len(texts)),
            )
        )
    for index, (text, single) in enumerate(zip(texts, singles, strict=True)):
        assert single.choices[0].message.content == text, index
        assert single.choices[0].finish_reason == reply.choices[index].finish_reason
    client.close()
