"""Stall-free prefill through the server, in process on the sim engine: a long prompt is
prefilled in chunks between the running streams' tokens, its answer carries admission's
predicted time to first token, and /v1/stats and /metrics show the lanes and the split
between prefill and decode (docs/stall-free.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from tests.support.inprocess import serve_in_process, streaming_client, wait_until

#: 4 ms a step and 0.1 ms a token, with a 20 ms TPOT objective: beside two streams a step
#: has room for about a hundred prompt tokens, so a 1,400-token prompt takes a dozen.
SIM = {
    "sim_step_base_ms": 4,
    "sim_step_per_token_ms": 0.1,
    "tpot_slo_ms": 20,
    "long_prompt_tokens": 500,
}


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]


async def test_a_long_prompt_is_prefilled_between_the_tokens_of_running_streams() -> None:
    async with serve_in_process(**SIM) as app, streaming_client(app) as client:
        received = [0, 0]

        async def stream(k: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"A long story, {k}."}],
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    for event in events([line]):
                        received[k] = event["usage"]["completion_tokens"]

        streams = [asyncio.create_task(stream(k)) for k in range(2)]
        await wait_until(lambda: min(received) >= 2, "both streams decode")
        body = {
            "messages": [{"role": "user", "content": "Summarize: " + "notes " * 230}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines: list[str] = []
        before = list(received)
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(line)
        # What the streams were sent by its end (a token a step, less a flush interval).
        during = [now - then for now, then in zip(received, before, strict=True)]
        for task in streams:
            task.cancel()
        usage = events(lines)[-1]["usage"]
        assert usage["prompt_tokens"] > 1000
        # Both streams kept getting tokens while the prompt was prefilled, chunk by chunk.
        assert min(during) >= 5
        assert usage["sluicegate"]["predicted_ttft_seconds"] > 0
        prefill = (await app.stats())["prefill"]
        assert prefill["stall_free"] and prefill["budget_limited_steps"] >= 5
        # Long until 500 tokens are left (long_prompt_tokens), then short.
        long_tokens = usage["prompt_tokens"] - 500
        assert prefill["lanes"]["long"]["tokens"] >= long_tokens
        assert prefill["tokens_by_phase"]["decode"]["interactive"] >= sum(received)
        metrics = await app.metrics()
        assert metrics.total('sluicegate_prefill_lane_tokens_total{lane="long"}') >= long_tokens
        assert metrics.total("sluicegate_prefill_budget_limited_steps_total") >= 5


async def test_one_budget_a_step_when_stall_free_prefill_is_off() -> None:
    async with serve_in_process("--no-stall-free-prefill", **SIM) as app:
        body = {"messages": [{"role": "user", "content": "notes " * 230}], "max_tokens": 2}
        response = await app.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        prefill = (await app.stats())["prefill"]
        assert not prefill["stall_free"] and prefill["budget_limited_steps"] == 0
