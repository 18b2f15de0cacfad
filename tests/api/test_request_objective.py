"""A request's own objective through the server, in process (sim engine):
``x-sluicegate-ttft-slo-ms`` looser or tighter than its class's, ``x-sluicegate-deadline``
refused at once when it cannot be met and refused from the queue when it passes, and a
bad header as a 400 that names it."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson

from tests.support.inprocess import InProcessApp, serve_in_process

MODEL = "sluicegate-sim"
#: Two seats at 20 ms a step: two 60-token answers hold the engine for about 1.2 s.
SIM = {"sim_step_base_ms": 20, "sim_step_per_token_ms": 0.0, "max_num_seqs": 2}


def body(prompt: str, max_tokens: int = 8) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


async def occupy(client: httpx.AsyncClient) -> list[asyncio.Task[httpx.Response]]:
    """Both seats, for about 1.2 s; returns once they are taken."""
    tasks = [
        asyncio.create_task(client.post("/v1/completions", json=body(f"long {i}", 60)))
        for i in range(2)
    ]
    await asyncio.sleep(0.2)
    return tasks


async def test_a_looser_objective_is_admitted_where_the_class_would_refuse() -> None:
    async with serve_in_process(**SIM, ttft_slo_ms=500, tpot_slo_ms=1000) as app:
        busy = await occupy(app.client)
        refused = await app.client.post("/v1/completions", json=body("class"))
        assert refused.status_code == 429  # ~0.9 s to a seat: past 0.5 s
        loose = await app.client.post(
            "/v1/completions", json=body("loose"), headers={"x-sluicegate-ttft-slo-ms": "5000"}
        )
        assert loose.status_code == 200, loose.text
        assert [r.status_code for r in await asyncio.gather(*busy)] == [200, 200]


async def test_a_tighter_objective_is_refused_where_the_class_would_admit() -> None:
    async with serve_in_process(**SIM, ttft_slo_ms=5000, tpot_slo_ms=1000) as app:
        busy = await occupy(app.client)
        tight = await app.client.post(
            "/v1/completions", json=body("tight"), headers={"x-sluicegate-ttft-slo-ms": "200"}
        )
        assert tight.status_code == 429, tight.text
        assert (
            "200" in tight.json()["error"]["message"] or "0.2s" in tight.json()["error"]["message"]
        )
        admitted = await app.client.post("/v1/completions", json=body("class"))
        assert admitted.status_code == 200
        assert [r.status_code for r in await asyncio.gather(*busy)] == [200, 200]


async def test_a_deadline_that_cannot_be_met_is_refused_at_once() -> None:
    async with serve_in_process(**SIM, tpot_slo_ms=1000) as app:
        busy = await occupy(app.client)
        started = time.monotonic()
        late = await app.client.post(
            "/v1/completions",
            json={**body("batch"), "priority": "batch"},
            headers={"x-sluicegate-deadline": str(time.time() + 0.5)},
        )
        assert time.monotonic() - started < 1.0  # not after waiting for it
        assert late.status_code == 429, late.text
        error = late.json()["error"]
        assert error["code"] == "deadline_unreachable" and "retry-after" not in late.headers
        assert [r.status_code for r in await asyncio.gather(*busy)] == [200, 200]


async def test_a_queued_request_is_refused_when_its_deadline_passes() -> None:
    async with serve_in_process(**SIM, admission="static") as app:
        busy = await occupy(app.client)
        queued = await app.client.post(
            "/v1/completions",
            json=body("queued"),
            headers={"x-sluicegate-deadline": str(time.time() + 0.4)},
        )
        assert queued.status_code == 429, queued.text
        assert queued.json()["error"]["code"] == "deadline_unreachable"
        assert [r.status_code for r in await asyncio.gather(*busy)] == [200, 200]
        await app.idle()  # the refused request holds no seat


async def test_a_bad_header_is_a_400_that_names_it() -> None:
    async with serve_in_process() as app:
        for header, value in (
            ("x-sluicegate-ttft-slo-ms", "soon"),
            ("x-sluicegate-ttft-slo-ms", "1"),
            ("x-sluicegate-deadline", "tomorrow"),
        ):
            reply = await app.client.post(
                "/v1/completions", json=body("x"), headers={header: value}
            )
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == header


async def test_an_answer_tells_the_objective_it_was_admitted_to_meet() -> None:
    """``usage.sluicegate.ttft_objective_seconds``: its class's, or its own; none under
    static admission (nothing was promised)."""

    async def objective_of(app: InProcessApp, headers: dict[str, str] | None = None) -> object:
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        reply = await app.client.post(
            "/v1/completions", json={**body("x"), **stream}, headers=headers
        )
        assert reply.status_code == 200, reply.text
        events = [
            orjson.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")
        ]
        return events[-1]["usage"]["sluicegate"]["ttft_objective_seconds"]

    async with serve_in_process(**SIM, ttft_slo_ms=500, tpot_slo_ms=1000) as app:
        assert await objective_of(app) == 0.5
        assert await objective_of(app, {"x-sluicegate-ttft-slo-ms": "5000"}) == 5.0
    async with serve_in_process(**SIM, admission="static") as app:
        assert await objective_of(app) is None
