"""Admission by latency objective, in process (sim engine).

What a request's time to first token comes to depends on how fast the machine keeps
the pace the cost model learnt; these tests check what admission decides, and bound
the times only generously (the prediction itself is tested with the fake clock in
tests/admission/test_slo.py; measured latencies are the bench's, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.support.inprocess import InProcessApp, serve_in_process

MODEL = "sluicegate-sim"
TTFT_OBJECTIVE = 0.5
#: 20 ms a step plus 0.2 ms a token: 64-token answers, a handful of requests a second.
SIM = {"sim_step_base_ms": 20, "sim_step_per_token_ms": 0.2}
SLO = {**SIM, "max_num_seqs": 8, "ttft_slo_ms": TTFT_OBJECTIVE * 1000, "tpot_slo_ms": 200}


@dataclass
class Outcome:
    status: int
    #: The server's time to first token (``usage.sluicegate.ttft_seconds``).
    ttft: float | None = None
    retry_after_ms: float | None = None
    code: str | None = None
    #: ``x-sluicegate-refusal``: a seat held (``slo_unreachable``) or not (``overloaded``).
    refusal: str | None = None
    message: str = ""


async def stream_once(client: httpx.AsyncClient, prompt: str, max_tokens: int = 64) -> Outcome:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        retry = response.headers.get("retry-after-ms")
        error = response.json()["error"]
        return Outcome(
            response.status_code,
            None,
            float(retry) if retry else None,
            error["code"],
            response.headers.get("x-sluicegate-refusal"),
            error["message"],
        )
    usage: dict[str, Any] | None = None
    for line in response.text.splitlines():
        if line.startswith('data: {"error"'):
            # Admitted, then told in the stream that its objective became unreachable.
            error = orjson.loads(line[6:])["error"]
            return Outcome(
                429,
                None,
                error.get("retry_after_ms"),
                error["code"],
                error.get("refusal"),
                error["message"],
            )
        if line.startswith("data: {"):
            usage = orjson.loads(line[6:]).get("usage") or usage
    assert usage is not None, response.text
    return Outcome(200, usage["sluicegate"]["ttft_seconds"])


async def burst(
    client: httpx.AsyncClient, count: int, spacing: float, max_tokens: int = 64
) -> list[Outcome]:
    async def one(i: int) -> Outcome:
        await asyncio.sleep(i * spacing)
        return await stream_once(client, f"burst {i}", max_tokens)

    return await asyncio.gather(*(one(i) for i in range(count)))


async def slo_refusals(app: InProcessApp) -> float:
    return (await app.metrics()).total('sluicegate_rejections_total{reason="slo_unreachable"}')


async def test_overload_is_refused_at_once_and_what_is_admitted_meets_its_objective() -> None:
    async with serve_in_process(**SLO) as app:
        outcomes = await burst(app.client, count=80, spacing=0.01)
        admitted = [o for o in outcomes if o.status == 200]
        refused = [o for o in outcomes if o.status != 200]
        assert admitted and refused
        assert {o.status for o in refused} == {429}
        assert {o.code for o in refused} == {"slo_unreachable"}
        assert {o.refusal for o in refused} <= {"slo_unreachable", "overloaded"}
        assert all(o.retry_after_ms is not None and o.retry_after_ms > 0 for o in refused)
        ttfts = sorted(o.ttft for o in admitted if o.ttft is not None)
        assert len(ttfts) == len(admitted)
        # What is admitted meets its objective, with room for the prediction's error.  The
        # server measured a p90 of 0.04 s quiet and 0.05 s with another process keeping
        # one of two cores busy: the bound is 15 times that; admitting all 80 on 8 seats
        # would make it about 10 s (nine rounds of 64 steps of 20 ms).
        assert ttfts[int(0.9 * (len(ttfts) - 1))] <= 1.5 * TTFT_OBJECTIVE
        assert await slo_refusals(app) == len(refused)


async def test_clients_that_come_back_at_the_advertised_time_are_admitted() -> None:
    async def client(http: httpx.AsyncClient, i: int) -> list[Outcome]:
        """One request of a burst; refused, it comes back when it was told to, until it
        is admitted."""
        # Short answers: the burst clears, and the refused come back, in a few seconds.
        await asyncio.sleep(i * 0.005)
        outcomes = [await stream_once(http, f"burst {i}", max_tokens=16)]
        while outcomes[-1].status == 429 and len(outcomes) < 20:
            retry_after_ms = outcomes[-1].retry_after_ms
            assert retry_after_ms is not None and 0 < retry_after_ms <= 60_000, outcomes
            await asyncio.sleep(retry_after_ms / 1000.0)
            # The same request again, as clients retry: recognised, it takes its seat.
            outcomes.append(await stream_once(http, f"burst {i}", max_tokens=16))
        return outcomes

    async with serve_in_process(**SLO) as app:
        clients = await asyncio.gather(*(client(app.client, i) for i in range(24)))
    assert any(len(outcomes) > 1 for outcomes in clients), "the burst overloaded nothing"
    # Every client that does as it is told gets in: refusals say when to come back, and
    # that time comes (how many come back once and are in depends on the machine keeping
    # the pace the cost model learnt: tests/admission/test_slo.py checks that, by the
    # fake clock, for a client back at its time).
    assert all(outcomes[-1].status == 200 for outcomes in clients), clients
    # A refusal with a seat held says so, and shows a prediction past the objective (or
    # names the promised clients it would make late); the client back at its time with
    # the same request takes that seat: admitted at its first retry.
    for outcomes in clients:
        for refused in outcomes[:-1]:
            assert refused.refusal == "slo_unreachable", refused
            assert "a seat is held for it" in refused.message
            assert "promised to" in refused.message or predicted(refused) > TTFT_OBJECTIVE
        assert len(outcomes) <= 2, outcomes


def predicted(outcome: Outcome) -> float:
    """The predicted TTFT a refusal's message shows."""
    return float(outcome.message.split("predicted ")[1].split("s")[0])


async def test_stats_and_metrics_show_the_objectives_the_limit_and_the_cost_model() -> None:
    async with serve_in_process(**SLO) as app:
        await burst(app.client, count=10, spacing=0.0, max_tokens=8)
        stats = await app.stats()
        admission = stats["admission"]
        assert isinstance(admission, dict) and admission["mode"] == "slo"
        assert admission["objectives"]["interactive"]["ttft_seconds"] == TTFT_OBJECTIVE
        seats = stats["seats"]
        assert isinstance(seats, dict) and 1 <= seats["seat_limit"] <= 8
        cost = stats["cost_model"]
        assert isinstance(cost, dict) and cost["observations"] > 0
        # The sim's law is 20 ms a step plus 0.2 ms a token: the model has learnt it
        # (measured: 19.8 to 20.2 ms, quiet or with one of two cores kept busy).
        assert cost["fixed_seconds"] == pytest.approx(0.020, rel=0.3)
        text = (await app.client.get("/metrics")).text
        assert "sluicegate_concurrency_limit " in text
        assert "sluicegate_ttft_prediction_error_seconds_bucket" in text


async def test_the_default_ttft_objective_is_sized_from_the_calibrated_engine() -> None:
    """``ttft_slo_ms: auto``: twice a 256-token prompt on the idle engine, at least 250 ms."""
    # 1 ms a step and 0.01 ms a token: the floor.
    async with serve_in_process() as app:
        admission = (await app.stats())["admission"]
        assert isinstance(admission, dict) and admission["ttft_objective"] == "auto"
        assert admission["objectives"]["interactive"]["ttft_seconds"] == 0.25
    # 20 ms + 256 x 0.5 ms = 148 ms for the prompt alone: 296 ms, rounded up to 10 ms.
    async with serve_in_process(sim_step_base_ms=20, sim_step_per_token_ms=0.5) as app:
        objective = (await app.stats())["admission"]["objectives"]["interactive"]
        # Measured: 0.30 every time, quiet or with one of two cores kept busy.
        assert objective["ttft_seconds"] == pytest.approx(0.30, abs=0.02)


async def test_static_admission_never_refuses_by_objective() -> None:
    settings = {**SIM, "max_num_seqs": 8, "admission": "static", "ttft_slo_ms": 100}
    async with serve_in_process(**settings) as app:
        outcomes = await burst(app.client, count=30, spacing=0.005, max_tokens=8)
        assert all(o.status == 200 for o in outcomes)
        assert (await app.stats())["admission"] == {
            "mode": "static",
            "ttft_objective": None,
            "objectives": {},
        }
