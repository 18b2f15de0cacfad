"""Prefix caching, in process (sim engine: the scheduler's cache is the same for every
engine): usage reports the reused tokens, /v1/stats and /metrics count them, and with
``prefix_cache_scope: tenant`` one tenant never reuses another's prefix."""

from __future__ import annotations

from typing import Any

import orjson

from tests.support.inprocess import InProcessApp, serve_in_process, wait_until

SYSTEM = "You answer questions about the opening hours of a bakery. " * 20
TENANTS = [{"name": "alpha", "api_key": "key-alpha"}, {"name": "beta", "api_key": "key-beta"}]
#: The sim at 4 ms a step, as the resume tests run it.
SIM = {"sim_step_base_ms": 4, "sim_step_per_token_ms": 0}


async def ask(app: InProcessApp, question: str, key: str | None = None) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = await app.client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def test_a_repeated_system_prompt_is_reused_and_reported() -> None:
    async with serve_in_process(**SIM) as app:
        first = await ask(app, "When do you open?")
        assert cached(first) == 0
        again = await ask(app, "When do you close?")
        assert again["prompt_tokens"] > cached(again) >= again["prompt_tokens"] - 32
        # Streamed, the usage chunk says so too.
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Open on Monday?"},
            ],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        streamed = await app.client.post("/v1/chat/completions", json=body)
        last = [line for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
        assert cached(orjson.loads(last[6:])["usage"]) > 0
        stats = (await app.stats())["prefix_cache"]
        assert stats["hits"] >= 1 and stats["hit_tokens"] >= cached(again)
        hit_tokens = (await app.metrics()).total(
            'sluicegate_prefix_cache_tokens_total{outcome="hit"}'
        )
        assert hit_tokens >= cached(again)


async def test_with_tenant_scope_a_tenant_reuses_only_its_own_prefixes() -> None:
    async with serve_in_process(tenants=TENANTS, prefix_cache_scope="tenant", **SIM) as app:
        assert cached(await ask(app, "When do you open?", "key-alpha")) == 0
        assert cached(await ask(app, "When do you open?", "key-beta")) == 0  # alpha's: not seen
        assert cached(await ask(app, "And on Sunday?", "key-alpha")) > 0
        assert cached(await ask(app, "And on Sunday?", "key-beta")) > 0  # its own, now


async def test_a_prefill_while_typing_warms_the_cache_for_the_final_request() -> None:
    system = "You are the reservation desk of a small hotel by the sea. " * 20
    typed = [{"role": "system", "content": system}, {"role": "user", "content": "Do you ha"}]
    async with serve_in_process(**SIM) as app:
        warm = await app.client.post("/v1/prefill", json={"messages": typed, "user": "u1"})
        assert warm.status_code == 202, warm.text
        body = warm.json()
        assert body["object"] == "prefill" and body["cached_tokens"] == 0
        assert body["prompt_tokens"] > 200

        async def warmed() -> bool:
            stats = await app.stats()
            return stats["prefill_requests"].get("completed", 0) >= 1

        await wait_until(warmed, "the warm-up to run and end")
        counts = (await app.stats())["prefill_requests"]
        assert counts["accepted"] >= 1 and counts["running"] == 0
        metric = 'sluicegate_prefill_requests_total{outcome="completed"}'
        assert (await app.metrics()).total(metric) == counts["completed"]
        final = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Do you have a room with a view?"},
        ]
        response = await app.client.post(
            "/v1/chat/completions", json={"messages": final, "max_tokens": 4}
        )
        usage = response.json()["usage"]
        assert cached(usage) >= body["prompt_tokens"] - 32  # all but the last words typed
        bad = await app.client.post("/v1/prefill", json={"messages": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
