"""The front door, in process: auth, rate limits, queue policies, fairness.

Queue states are made with the engine held at a gate
(:func:`tests.support.inprocess.gate_engine`): while it is closed nothing finishes, so
what holds the seats and the queue is exactly what the test put there, however slow the
machine.  Rate limits are configured so that they cannot refill during a test; their
refill is tested with the fake clock (tests/admission/test_controller.py).
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import httpx
import openai
import pytest

from tests.simtext import expected_completion
from tests.support.inprocess import InProcessApp, gate_engine, serve_in_process, wait_until

MODEL = "sluicegate-sim"
#: Two seats and room for two in the queue; static admission: these tests are about the
#: queue's own limits and policies (the objectives' refusals are in test_slo_admission.py).
SMALL = {"admission": "static", "max_num_seqs": 2, "max_queued_requests": 2}


def completion(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def live(app: InProcessApp) -> int:
    """Requests the server holds: running, queued, or waiting for room in the queue."""
    return int((await app.stats())["live_requests"])


async def queued(app: InProcessApp) -> int:
    return int((await app.stats())["queue"]["queued"])


async def fill(
    app: InProcessApp, n: int, max_tokens: int = 40
) -> list[asyncio.Task[httpx.Response]]:
    """``n`` requests, each in the server before the next is sent: the first take the
    seats, the rest queue in order."""
    tasks = []
    for _ in range(n):
        before = await live(app)
        body = completion(max_tokens=max_tokens)
        tasks.append(asyncio.create_task(app.client.post("/v1/completions", json=body)))
        await wait_until(functools.partial(_more_than, app, before), "the request to arrive")
    return tasks


async def _more_than(app: InProcessApp, count: int) -> bool:
    return await live(app) > count


async def rejections(app: InProcessApp, reason: str) -> float:
    return (await app.metrics()).total(f'sluicegate_rejections_total{{reason="{reason}"}}')


TENANTS = [
    # A burst of 2, then one request every 100 s: nothing refills while the test runs.
    {"name": "alpha", "api_key": "key-alpha", "requests_per_second": 0.01, "request_burst": 2},
    # 600 tokens a minute (10 a second): after the first 500-token request, the second
    # needs 40 s of refill.
    {"name": "beta", "api_key": "key-beta", "tokens_per_minute": 600},
]


async def test_auth_and_rate_limits() -> None:
    async with serve_in_process(admission="static", tenants=TENANTS) as app:
        url = "/v1/completions"
        missing = await app.client.post(url, json=completion())
        assert missing.status_code == 401
        assert "Authorization" in missing.json()["error"]["message"]
        wrong = await app.client.post(url, json=completion(), headers=auth("nope"))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

        # alpha: a burst of 2: five in a row admit exactly 2.
        statuses = [
            await app.client.post(url, json=completion(), headers=auth("key-alpha"))
            for _ in range(5)
        ]
        assert [r.status_code for r in statuses] == [200, 200, 429, 429, 429]
        limited = statuses[2]
        assert limited.json()["error"]["type"] == "rate_limited_requests"
        # The next request fits in 100 s: Retry-After is capped at max_retry_after_seconds.
        assert limited.headers["retry-after"] == "60"
        assert limited.headers["x-ratelimit-limit-requests"] == "2"
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-reset-requests" in limited.headers
        assert "x-ratelimit-limit-requests" in statuses[0].headers

        # beta: 600 tokens/min; prompt + max_tokens is reserved at admission.
        beta = auth("key-beta")
        big = await app.client.post(url, json=completion(max_tokens=500), headers=beta)
        assert big.status_code == 200
        again = await app.client.post(url, json=completion(max_tokens=500), headers=beta)
        assert again.status_code == 429
        assert again.json()["error"]["type"] == "rate_limited_tokens"
        assert "x-ratelimit-remaining-tokens" in again.headers
        never = await app.client.post(url, json=completion(max_tokens=900), headers=beta)
        assert never.status_code == 400  # can never fit in a 600-token bucket
        metrics = await app.metrics()
        assert metrics.total('sluicegate_rejections_total{reason="auth"}') == 2
        assert metrics.total('sluicegate_rejections_total{reason="rate_limited_requests"}') == 3


async def test_openai_client_retries_on_retry_after_and_succeeds() -> None:
    # One request a second (burst 1): the second call in a row is rate limited.  Between
    # the first request and the retrying client's first try pass milliseconds (two calls
    # in process), not the second that would let the bucket refill.
    tenants = [{"name": "t", "api_key": "k", "requests_per_second": 1}]
    async with serve_in_process(admission="static", tenants=tenants) as app:
        no_retry = app.openai(api_key="k", max_retries=0)
        await no_retry.completions.create(model=MODEL, prompt="a", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            await no_retry.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        refused_before = await rejections(app, "rate_limited_requests")
        client = app.openai(api_key="k", max_retries=3)
        # Still limited: the client waits our Retry-After and then succeeds.  The sim's
        # text is a function of (seed, prompt) whose characters can span several tokens:
        # a fixed seed and enough tokens make it whole, known and non-empty.
        result = await client.completions.create(model=MODEL, prompt="a", max_tokens=8, seed=3)
        assert result.choices[0].text == expected_completion("a", 3, 8) != ""
        assert result.choices[0].finish_reason == "length"
        assert result.usage is not None and result.usage.completion_tokens == 8
        # It was refused, and retried on its own: the server saw it come back.
        assert 1 <= await rejections(app, "rate_limited_requests") - refused_before <= 3


async def test_policy_reject() -> None:
    async with serve_in_process(queue_policy="reject", **SMALL) as app:
        with gate_engine(app) as gate:
            tasks = await fill(app, 4)  # 2 running + 2 queued
            assert await queued(app) == 2
            extra = await app.client.post("/v1/completions", json=completion())
            assert extra.status_code == 429
            assert extra.json()["error"]["code"] == "queue_full"
            assert int(extra.headers["retry-after"]) >= 1
            gate.open()
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


async def test_policy_block_with_deadline() -> None:
    async with serve_in_process(queue_policy="block", max_queue_wait_seconds=0.5, **SMALL) as app:
        with gate_engine(app) as gate:
            tasks = await fill(app, 4)
            loop = asyncio.get_running_loop()
            started = loop.time()
            extra = await app.client.post("/v1/completions", json=completion())
            waited = loop.time() - started
            assert extra.status_code == 503, extra.text
            assert extra.json()["error"]["code"] == "queue_timeout"
            assert "retry-after" in extra.headers
            assert waited >= 0.5  # it waited for room until its deadline
            # The deadline covers the wait in the queue too: the two queued behind the
            # held engine did not reach it within 0.5 s either.
            await wait_until(lambda: all(t.done() for t in tasks[2:]), "the queued to expire")
            gate.open()
            first = await asyncio.gather(*tasks)
        assert [r.status_code for r in first] == [200, 200, 503, 503]


async def test_policy_block_waits_for_room_and_gets_in() -> None:
    async with serve_in_process(queue_policy="block", max_queue_wait_seconds=30, **SMALL) as app:
        with gate_engine(app) as gate:
            tasks = await fill(app, 5, max_tokens=5)
            # Two seats, two queued, and the fifth waits for room in the queue.
            assert await queued(app) == 2 and await live(app) == 5
            gate.open()
            results = await asyncio.gather(*tasks)
        assert all(r.status_code == 200 for r in results), [r.text for r in results]


async def test_policy_drop_oldest() -> None:
    async with serve_in_process(queue_policy="drop-oldest", **SMALL) as app:
        with gate_engine(app) as gate:
            tasks = await fill(app, 4)
            newest = asyncio.create_task(app.client.post("/v1/completions", json=completion()))
            # The oldest queued one makes room, at once.
            dropped = await tasks[2]
            assert dropped.status_code == 503
            assert "drop-oldest" in dropped.json()["error"]["message"]
            assert await queued(app) == 2
            gate.open()
            results = await asyncio.gather(*tasks)
            assert (await newest).status_code == 200
        statuses = [r.status_code for r in results]
        assert statuses == [200, 200, 503, 200]


async def test_queued_stream_is_told_its_position() -> None:
    async with serve_in_process(**SMALL) as app:
        with gate_engine(app) as gate:
            tasks = await fill(app, 3)  # 2 running, 1 queued
            body = completion(max_tokens=5, stream=True)
            stream = asyncio.create_task(app.client.post("/v1/completions", json=body))
            await wait_until(functools.partial(_more_than, app, 3), "the stream to queue")
            gate.open()
            response = await stream
            await asyncio.gather(*tasks)
    comments = [line for line in response.text.splitlines() if line.startswith(": queued")]
    # One request is queued ahead of it (0-based position 1); the estimate is in ms.
    assert comments, response.text
    position, eta = comments[0].removeprefix(": queued ").split(" ")
    assert position == "position=1" and eta.startswith("eta_ms=") and eta[7:].isdigit()


async def test_retry_after_is_the_queue_ahead_at_the_measured_service_rate() -> None:
    # One seat, 20 tokens at 8 ms a step: at least 0.16 s per request, at most 6.25 a
    # second; 8 queued make more than the 1 s that Retry-After is never below.
    settings = {"max_num_seqs": 1, "max_queued_requests": 8, "sim_step_base_ms": 8}
    async with serve_in_process(admission="static", **settings) as app:
        url = "/v1/completions"
        loop = asyncio.get_running_loop()
        done_at = []
        for _ in range(6):  # the server measures its service rate from these
            assert (await app.client.post(url, json=completion(max_tokens=20))).status_code == 200
            done_at.append(loop.time())
        # The rate the server measured is the one this client saw (the same completions).
        seen_rate = 5 / (done_at[-1] - done_at[0])
        measured = (await app.stats())["queue"]["service_rate_requests_per_second"]
        assert measured == pytest.approx(seen_rate, rel=0.3)
        with gate_engine(app) as gate:
            tasks = await fill(app, 9, max_tokens=20)  # 1 running + 8 queued
            refused = await app.client.post(url, json=completion(max_tokens=20))
            assert refused.status_code == 429
            # Retry-After is whole seconds (rounded up); retry-after-ms is the estimate.
            advertised = int(refused.headers["retry-after-ms"]) / 1000
            assert int(refused.headers["retry-after"]) == math.ceil(advertised)
            # The estimate is the 8 queued ahead at the rate the server measures now
            # (nothing has moved since: the engine is held).
            rate = (await app.stats())["queue"]["service_rate_requests_per_second"]
            assert advertised == pytest.approx(8 / rate, rel=0.05)
            # A fact, however fast the machine: 8 requests of at least 0.16 s on one seat.
            assert advertised >= 8 * 0.16 * 0.99
            gate.open()
            # Back once the queue has drained: admitted.
            await wait_until(functools.partial(_queue_empty, app), "the queue to drain")
            back = await app.client.post(url, json=completion(max_tokens=20))
            assert back.status_code == 200
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


async def _queue_empty(app: InProcessApp) -> bool:
    return await queued(app) == 0


async def test_fair_share_between_tenants_by_weight() -> None:
    tenants = [
        {"name": "heavy", "api_key": "kh", "weight": 1},
        {"name": "light", "api_key": "kl", "weight": 2},
    ]
    settings = {"admission": "static", "max_num_seqs": 2, "max_queued_requests": 200}
    async with serve_in_process(tenants=tenants, **settings) as app:
        with gate_engine(app) as gate:
            # Both tenants backlogged before anything runs: heavy queues 4x as many requests
            # as light (still queued when light's 10 are done).
            heavy = await send_all(app, "kh", 40)
            light = await send_all(app, "kl", 10)
            assert await queued(app) == 48  # the first two heavy ones hold the seats
            gate.open()
            responses = {
                name: await asyncio.gather(*tasks)
                for name, tasks in (("heavy", heavy), ("light", light))
            }
        tenant_of = {r.headers["x-request-id"]: name for name, rs in responses.items() for r in rs}
        assert all(r.status_code == 200 for rs in responses.values() for r in rs)
        # The order in which the engine first ran them, as the fair queue dispatched them:
        # the first two started before light arrived; then, while both had work queued,
        # light (weight 2) gets two of every three seats until its 10 are done.
        order = [tenant_of[rid] for rid in gate.first_run]
        assert len(order) == 50 and order[:2] == ["heavy", "heavy"]
        window = order[2:17]
        thirds = [window[i : i + 3] for i in range(0, len(window), 3)]
        assert all(third.count("light") == 2 for third in thirds), order
        assert order[17:] == ["heavy"] * 33  # then heavy has the seats to itself
        # The weights the queue serves by are the configured ones.
        queue = app.service.dispatcher.queue
        assert (queue.weight("heavy"), queue.weight("light")) == (1, 2)


async def send_all(app: InProcessApp, key: str, n: int) -> list[asyncio.Task[httpx.Response]]:
    """``n`` requests of one tenant, all in the server (queued or seated) on return."""
    before = await live(app)
    tasks = [
        asyncio.create_task(
            app.client.post("/v1/completions", json=completion(max_tokens=20), headers=auth(key))
        )
        for _ in range(n)
    ]
    await wait_until(functools.partial(_more_than, app, before + n - 1), f"{n} of {key}")
    return tasks
