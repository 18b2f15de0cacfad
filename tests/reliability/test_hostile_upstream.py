"""An upstream that breaks the protocol costs the gateway a bounded amount (issue #31,
item 1): an answer past ``max_tokens`` is cut there, with ``length``, and counted; an
event larger than ``upstream_max_event_bytes`` fails the call without being held whole.
In process, against a scripted upstream on a real socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluicegate.bench.hostile import SCENARIOS, hostile_upstreams
from sluicegate.bench.scrape import parse_metrics
from tests.upstream.scripted import MODEL, Answer, text
from tests.upstream.test_passthrough import gateway, sse_chunks
from tests.upstream.test_restart import parts

MESSAGES = [{"role": "user", "content": "Say x."}]


def endless(body: dict[str, Any], attempt: int) -> Answer:
    """It ignores ``max_tokens``: 400 tokens of text, whatever it was asked."""
    return Answer([text("word ") for _ in range(400)] + [text("", 0, "stop")])


async def _metric(app: Any, reason: str) -> float:
    """``sluicegate_upstream_protocol_errors_total`` summed over the label sets that
    name ``reason``."""
    snapshot = parse_metrics((await app.client.get("/metrics")).text)
    name = "sluicegate_upstream_protocol_errors_total{"
    return sum(v for k, v in snapshot.values.items() if k.startswith(name) and reason in k)


async def test_an_answer_past_max_tokens_is_cut_there() -> None:
    async with gateway(endless) as (app, upstream):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "stream": True}
        response = await app.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        content, _, finishes = parts(sse_chunks(response.text))
        # At most one event a token (plus the one that finishes): 51 of its 400 events.
        assert content.count("word") <= 51 and finishes == ["length"]
        assert upstream.calls[-1]["max_tokens"] == 50
        assert await _metric(app, 'reason="max_tokens"') == 1.0
        # Not streamed: the same bound, and an answer.
        whole = await app.client.post(
            "/v1/chat/completions", json={**body, "stream": False}, timeout=60
        )
        assert whole.status_code == 200, whole.text
        choice = whole.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].count("word") <= 51
        assert await _metric(app, 'reason="max_tokens"') == 2.0


async def test_an_honest_answer_of_max_tokens_is_not_cut() -> None:
    def honest(body: dict[str, Any], attempt: int) -> Answer:
        n = int(body["max_tokens"])
        return Answer([text("word ") for _ in range(n - 1)] + [text("word ", 0, "length")])

    async with gateway(honest) as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "stream": True}
        response = await app.client.post("/v1/chat/completions", json=body)
        content, _, finishes = parts(sse_chunks(response.text))
        assert content.count("word") == 30 and finishes == ["length"]
        assert await _metric(app, "max_tokens") == 0.0


async def test_a_huge_event_fails_the_call_without_being_held() -> None:
    """One 10 MB event: the gateway reads at most ``upstream_max_event_bytes`` of it,
    counts it, and the request ends with a clear error after its bounded retries (the
    upstream, failing each, is ejected: a 503 to retry later)."""

    def huge(body: dict[str, Any], attempt: int) -> Answer:
        return Answer([text("x" * 10_000_000, 0, "stop")])

    async with gateway(huge, "--upstream-max-event-bytes", "65536") as (app, _):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50}
        response = await app.client.post("/v1/chat/completions", json=body, timeout=120)
        # Failed on each try, it is ejected: the client is told at once to retry later.
        assert response.status_code in (502, 503), response.text
        error = response.json()["error"]
        assert error["code"] in ("upstream_failed", "upstream_unavailable"), error
        assert await _metric(app, "event_too_large") >= 1.0
        assert (await app.client.get("/health")).status_code == 200


@pytest.mark.slow
def test_the_hostile_upstream_bench_runs_every_scenario(tmp_path: Path) -> None:
    """``sluicegate bench hostile`` at half a second a scenario (each of its clients
    sends a request or more; the drip's take seconds whatever this says): every client
    answer stays within max_tokens and ends (cut, or an error event), whatever the
    upstream does."""
    results = hostile_upstreams(tmp_path, seconds=0.5)
    assert [r.scenario for r in results] == list(SCENARIOS)
    for result in results:
        assert result.answers and result.within_max_tokens, result.line()
        assert "none" not in result.answers, result.line()  # every answer ended
    assert (tmp_path / "hostile.md").read_text().count("\n") == 2 + len(SCENARIOS)
