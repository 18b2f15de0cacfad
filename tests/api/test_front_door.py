"""The front door through the real server: auth, rate limits, queue policies, fairness."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.simtext import expected_completion
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


def config_file(tmp_path: Path, name: str, **settings: Any) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


@contextlib.contextmanager
def server(tmp_path: Path, name: str, **settings: Any) -> Iterator[ServerProcess]:
    # Static admission: these tests are about the queue's own limits and policies (the
    # objectives' refusals are tested in test_slo_admission.py).
    base = {
        "engine": "sim",
        "sim_step_base_ms": 5,
        "sim_step_per_token_ms": 0.0,
        "admission": "static",
    }
    proc = start_server(["--config", config_file(tmp_path, name, **{**base, **settings})], name)
    try:
        yield proc
    finally:
        proc.stop()


def completion(key: str | None = None, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, **extra}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


TENANTS = [
    {"name": "alpha", "api_key": "key-alpha", "requests_per_second": 2},
    {"name": "beta", "api_key": "key-beta", "tokens_per_minute": 600},
]


def test_auth_and_rate_limits(tmp_path: Path) -> None:
    with server(tmp_path, "auth", tenants=TENANTS) as srv:
        url = srv.v1 + "/completions"
        missing = httpx.post(url, json=completion(), timeout=10)
        assert missing.status_code == 401
        assert "Authorization" in missing.json()["error"]["message"]
        wrong = httpx.post(url, json=completion(), headers=auth("nope"), timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"

        # alpha: 2 requests/s with a burst of 2: a burst of 5 admits exactly 2.
        statuses = [
            httpx.post(url, json=completion(), headers=auth("key-alpha"), timeout=10)
            for _ in range(5)
        ]
        assert [r.status_code for r in statuses] == [200, 200, 429, 429, 429]
        limited = statuses[2]
        assert limited.json()["error"]["type"] == "rate_limited_requests"
        assert 1 <= int(limited.headers["retry-after"]) <= 2
        assert limited.headers["x-ratelimit-limit-requests"] == "2"
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-reset-requests" in limited.headers
        assert "x-ratelimit-limit-requests" in statuses[0].headers
        time.sleep(0.6)  # refill at 2/s: one more request fits
        ok = httpx.post(url, json=completion(), headers=auth("key-alpha"), timeout=10)
        assert ok.status_code == 200

        # beta: 600 tokens/min; prompt + max_tokens is reserved at admission.
        big = httpx.post(url, json=completion(max_tokens=500), headers=auth("key-beta"), timeout=10)
        assert big.status_code == 200
        again = httpx.post(
            url, json=completion(max_tokens=500), headers=auth("key-beta"), timeout=10
        )
        assert again.status_code == 429
        assert again.json()["error"]["type"] == "rate_limited_tokens"
        assert "x-ratelimit-remaining-tokens" in again.headers
        never = httpx.post(
            url, json=completion(max_tokens=900), headers=auth("key-beta"), timeout=10
        )
        assert never.status_code == 400  # can never fit in a 600-token bucket
        metrics = httpx.get(srv.base_url + "/metrics", timeout=5).text
        assert 'sluicegate_rejections_total{reason="auth"} 2.0' in metrics
        assert 'sluicegate_rejections_total{reason="rate_limited_requests"} 3.0' in metrics


def test_openai_client_retries_on_retry_after_and_succeeds(tmp_path: Path) -> None:
    # One request every 2 s (burst 1): the second call in a row is rate limited.
    tenants = [{"name": "t", "api_key": "k", "requests_per_second": 0.5}]
    with server(tmp_path, "retry", tenants=tenants) as srv:
        no_retry = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0)
        no_retry.completions.create(model=MODEL, prompt="a", max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            no_retry.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) in (1, 2)
        client = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=3)
        started = time.monotonic()
        # Still limited: the client waits our Retry-After and then succeeds.  The sim's
        # text is a function of (seed, prompt) whose characters can span several tokens:
        # a fixed seed and enough tokens make it whole, known and non-empty.
        result = client.completions.create(model=MODEL, prompt="a", max_tokens=8, seed=3)
        assert result.choices[0].text == expected_completion("a", 3, 8) != ""
        assert result.choices[0].finish_reason == "length"
        assert result.usage is not None and result.usage.completion_tokens == 8
        assert time.monotonic() - started >= 0.8
        client.close()
        no_retry.close()


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(url, json=body)


SLOW = {"max_num_seqs": 2, "max_queued_requests": 2, "sim_step_base_ms": 20}


async def _fill(
    srv: ServerProcess, n: int
) -> tuple[httpx.AsyncClient, list[asyncio.Task[httpx.Response]]]:
    client = httpx.AsyncClient(timeout=30)
    tasks = []
    for _ in range(n):
        tasks.append(
            asyncio.create_task(_post(client, srv.v1 + "/completions", completion(max_tokens=40)))
        )
        await asyncio.sleep(0.05)  # in order
    return client, tasks


async def test_policy_reject(tmp_path: Path) -> None:
    with server(tmp_path, "reject", queue_policy="reject", **SLOW) as srv:
        client, tasks = await _fill(srv, 4)  # 2 running + 2 queued
        extra = await client.post(srv.v1 + "/completions", json=completion())
        assert extra.status_code == 429
        assert extra.json()["error"]["code"] == "queue_full"
        assert int(extra.headers["retry-after"]) >= 1
        assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
        await client.aclose()


async def test_policy_block_with_deadline(tmp_path: Path) -> None:
    with server(tmp_path, "block", queue_policy="block", max_queue_wait_seconds=0.5, **SLOW) as srv:
        client, tasks = await _fill(srv, 4)
        started = time.monotonic()
        extra = await client.post(srv.v1 + "/completions", json=completion())
        waited = time.monotonic() - started
        assert extra.status_code == 503, extra.text
        assert extra.json()["error"]["code"] == "queue_timeout"
        assert "retry-after" in extra.headers
        assert 0.4 <= waited < 2.0
        # The deadline covers the wait in the queue too: the two queued behind 0.8 s
        # requests did not reach the engine within 0.5 s either.
        first = await asyncio.gather(*tasks)
        assert [r.status_code for r in first] == [200, 200, 503, 503]
        # With room freeing before the deadline, a blocked request waits and gets in.
        srv_tasks = [
            asyncio.create_task(client.post(srv.v1 + "/completions", json=completion(max_tokens=5)))
            for _ in range(5)
        ]
        results = await asyncio.gather(*srv_tasks)
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        await client.aclose()


async def test_policy_drop_oldest(tmp_path: Path) -> None:
    with server(tmp_path, "drop", queue_policy="drop-oldest", **SLOW) as srv:
        client, tasks = await _fill(srv, 4)
        newest = await client.post(srv.v1 + "/completions", json=completion())
        assert newest.status_code == 200
        results = await asyncio.gather(*tasks)
        statuses = [r.status_code for r in results]
        assert statuses[:2] == [200, 200]
        dropped = results[2]  # the oldest queued one made room
        assert dropped.status_code == 503
        assert "drop-oldest" in dropped.json()["error"]["message"]
        assert statuses[3] == 200
        await client.aclose()


async def test_queued_stream_is_told_its_position(tmp_path: Path) -> None:
    with server(tmp_path, "position", **SLOW) as srv:
        client, tasks = await _fill(srv, 3)  # 2 running, 1 queued
        body = completion(max_tokens=5, stream=True)
        comments: list[str] = []
        async with client.stream("POST", srv.v1 + "/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith(": queued"):
                    comments.append(line)
        assert comments and "position=" in comments[0] and "eta_ms=" in comments[0]
        await asyncio.gather(*tasks)
        await client.aclose()


async def test_retry_after_matches_the_wait_actually_experienced(tmp_path: Path) -> None:
    # One slot, 30 tokens at 10 ms a step: 0.3 s per request, 3.3 requests/s.
    settings = {"max_num_seqs": 1, "max_queued_requests": 8, "sim_step_base_ms": 10}
    with server(tmp_path, "retryafter", **settings) as srv:
        client = httpx.AsyncClient(timeout=60)
        url = srv.v1 + "/completions"
        for _ in range(6):  # let the server measure its service rate
            assert (await client.post(url, json=completion(max_tokens=30))).status_code == 200
        tasks = []
        for _ in range(9):  # 1 running + 8 queued
            tasks.append(asyncio.create_task(client.post(url, json=completion(max_tokens=30))))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        refused = await client.post(url, json=completion(max_tokens=30))
        assert refused.status_code == 429
        # Retry-After is whole seconds (rounded up); retry-after-ms is the estimate itself.
        advertised = int(refused.headers["retry-after-ms"]) / 1000
        assert int(refused.headers["retry-after"]) == math.ceil(advertised)
        started = time.monotonic()
        # The wait actually experienced: until the queue has drained and a retry gets in.
        while (await client.get(srv.base_url + "/v1/stats")).json()["queue"]["queued"] > 0:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        experienced = time.monotonic() - started
        assert abs(advertised - experienced) <= 0.3 * experienced, (advertised, experienced)
        await asyncio.sleep(max(0.0, advertised - experienced))
        back = await client.post(url, json=completion(max_tokens=30))
        assert back.status_code == 200
        await asyncio.gather(*tasks)
        await client.aclose()


async def test_fair_share_between_tenants_by_weight(tmp_path: Path) -> None:
    tenants = [
        {"name": "heavy", "api_key": "kh", "weight": 1},
        {"name": "light", "api_key": "kl", "weight": 2},
    ]
    settings = {"max_num_seqs": 2, "max_queued_requests": 200, "sim_step_base_ms": 5}
    with server(tmp_path, "fair", tenants=tenants, **settings) as srv:
        # More connections than requests, or the client's own pool would queue them.
        client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200))
        url = srv.v1 + "/completions"
        done: list[tuple[float, str]] = []

        async def one(key: str, name: str) -> None:
            r = await client.post(url, json=completion(max_tokens=20), headers=auth(key))
            assert r.status_code == 200
            done.append((time.monotonic(), name))

        # Both tenants backlogged: heavy floods 4x as many requests as light (still
        # queued when light's 10 are done).
        tasks = [asyncio.create_task(one("kh", "heavy")) for _ in range(40)]
        tasks += [asyncio.create_task(one("kl", "light")) for _ in range(10)]
        await asyncio.gather(*tasks)
        # The first two started before light arrived; then, while both had work queued,
        # light (weight 2) should get two of every three slots until its 10 are done.
        first = sorted(done)[2:17]
        light = sum(1 for _, n in first if n == "light")
        heavy = len(first) - light
        # Tokens served split by weights (2:1) within 10% of the total.
        assert abs(light / len(first) - 2 / 3) <= 0.1, (light, heavy)
        await client.aclose()
