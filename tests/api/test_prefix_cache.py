"""Prefix caching through the real server (sim engine: the scheduler's cache is the same
for every engine): usage reports the reused tokens, /v1/stats and /metrics count them,
and with ``prefix_cache_scope: tenant`` one tenant never reuses another's prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.resume.conftest import SIM, config_file
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

SYSTEM = "You answer questions about the opening hours of a bakery. " * 20
TENANTS = [{"name": "alpha", "api_key": "key-alpha"}, {"name": "beta", "api_key": "key-beta"}]


def ask(server: ServerProcess, question: str, key: str | None = None) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }
    headers = {"authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(server.v1 + "/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(SIM, "prefix")
    yield srv
    srv.stop()


def test_a_repeated_system_prompt_is_reused_and_reported(server: ServerProcess) -> None:
    first = ask(server, "When do you open?")
    assert cached(first) == 0
    again = ask(server, "When do you close?")
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
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=30) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert cached(orjson.loads(last[6:])["usage"]) > 0
    stats = server.stats()["prefix_cache"]
    assert stats["hits"] >= 1 and stats["hit_tokens"] >= cached(again)
    assert server.metrics().total('sluicegate_prefix_cache_tokens_total{outcome="hit"}') >= (
        cached(again)
    )


def test_with_tenant_scope_a_tenant_reuses_only_its_own_prefixes(tmp_path: Path) -> None:
    config = config_file(tmp_path, "scope", {"tenants": TENANTS, "prefix_cache_scope": "tenant"})
    srv = start_server([*SIM, "--config", config], "prefix-scope")
    try:
        assert cached(ask(srv, "When do you open?", "key-alpha")) == 0
        assert cached(ask(srv, "When do you open?", "key-beta")) == 0  # alpha's: not seen
        assert cached(ask(srv, "And on Sunday?", "key-alpha")) > 0
        assert cached(ask(srv, "And on Sunday?", "key-beta")) > 0  # its own, now
    finally:
        srv.stop()


def test_a_prefill_while_typing_warms_the_cache_for_the_final_request(
    server: ServerProcess,
) -> None:
    system = "You are the reservation desk of a small hotel by the sea. " * 20
    typed = [{"role": "system", "content": system}, {"role": "user", "content": "Do you ha"}]
    queries = server.stats()["prefix_cache"]["queries"]
    warm = httpx.post(server.v1 + "/prefill", json={"messages": typed, "user": "u1"}, timeout=10)
    assert warm.status_code == 202, warm.text
    body = warm.json()
    assert body["object"] == "prefill" and body["cached_tokens"] == 0
    assert body["prompt_tokens"] > 200
    deadline = time.monotonic() + 10
    while (stats := server.stats())["prefix_cache"]["queries"] == queries or stats[
        "requests_running"
    ]:  # the warm-up has been scheduled, and has ended
        assert time.monotonic() < deadline, "the warm-up never ran"
        time.sleep(0.05)
    while (counts := server.stats()["prefill_requests"]).get("completed", 0) < 1:
        assert time.monotonic() < deadline, counts
        time.sleep(0.05)
    assert counts["accepted"] >= 1 and counts["running"] == 0
    metric = 'sluicegate_prefill_requests_total{outcome="completed"}'
    assert server.metrics().total(metric) == counts["completed"]
    final = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Do you have a room with a view?"},
    ]
    response = httpx.post(
        server.v1 + "/chat/completions", json={"messages": final, "max_tokens": 4}, timeout=30
    )
    usage = response.json()["usage"]
    assert cached(usage) >= body["prompt_tokens"] - 32  # all but the last words typed
    bad = httpx.post(server.v1 + "/prefill", json={"messages": "nope"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
