"""``max_tokens_per_second``, in process: a floor on the pace, and slow paces that cannot
hold every seat."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.support.inprocess import InProcessApp, serve_in_process, streaming_client, wait_until

MODEL = "sluicegate-sim"
SETTINGS: dict[str, Any] = {
    "sim_step_base_ms": 2,
    "sim_step_per_token_ms": 0,
    "max_num_seqs": 4,
    "flush_interval_ms": 0,
}


async def test_a_pace_below_the_floor_is_a_400_naming_the_floor() -> None:
    async with serve_in_process(**SETTINGS) as app:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "max_tokens_per_second": 0.0001}
        refused = await app.client.post("/v1/completions", json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "max_tokens_per_second" and error["code"] == "invalid_value"
        assert "at least 1 " in error["message"] and "0.0001" in error["message"]
        assert "pace_floor_tokens_per_second" in error["message"]
        fast_enough = {**body, "max_tokens_per_second": 1, "max_tokens": 2}
        assert (await app.client.post("/v1/completions", json=fast_enough)).status_code == 200


async def running_and_throttled(app: InProcessApp) -> tuple[int, int]:
    stats = await app.stats()
    return stats["requests_running"], stats["requests_throttled"]


async def test_four_slow_streams_do_not_hold_the_four_seats() -> None:
    # A queue wait longer than the test: if the slow streams held their seats, the fifth
    # request would wait out their two minutes and be refused after 30 s.
    async with (
        serve_in_process(max_queue_wait_seconds=30, **SETTINGS) as app,
        streaming_client(app) as client,
    ):
        owners: list[dict[str, str]] = []

        async def slow_stream(i: int) -> None:
            body = {
                "model": MODEL,
                "prompt": f"slow {i}",
                "max_tokens": 120,
                "ignore_eos": True,
                "stream": True,
                "max_tokens_per_second": 1,
            }
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                owners.append(
                    {
                        "id": resp.headers["x-request-id"],
                        "x-sluicegate-resume-token": resp.headers["x-sluicegate-resume-token"],
                    }
                )
                async for _ in resp.aiter_lines():
                    pass

        streams = [asyncio.create_task(slow_stream(i)) for i in range(4)]
        # Each has had its token of slack and waits a second for its next: every seat is
        # lent by a stream that waits for its pace, none is held.
        await wait_until(lambda: _state(app, (4, 4)), "four throttled streams")
        fifth = await app.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 30}
        )
        assert fifth.status_code == 200, fifth.text
        assert fifth.json()["usage"]["completion_tokens"] == 30
        # The slow streams went on at their pace meanwhile (two minutes each), and stop at
        # once when cancelled.
        assert (await app.stats())["requests_throttled"] == 4
        for owner in owners:
            cancel = f"/v1/requests/{owner['id']}/cancel"
            assert (await app.client.post(cancel, headers=owner)).status_code == 200
        await asyncio.gather(*streams)
        await wait_until(lambda: _state(app, (0, 0)), "the cancels to show")
        assert (await app.stats())["kv_cache"]["used_blocks"] == 0


async def _state(app: InProcessApp, running_throttled: tuple[int, int]) -> bool:
    return await running_and_throttled(app) == running_throttled
