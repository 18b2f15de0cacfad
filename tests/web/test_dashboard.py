"""The live dashboard in headless Chromium while streaming clients load the real server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
import pytest

from tests.support.servers import ARTIFACTS, ServerProcess, start_server
from tests.web.browser import MODEL, wait_until
from tests.web.load import StreamingLoad

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route

pytestmark = pytest.mark.slow

# Few slots, a small KV cache and a concurrency cap: the load queues, fills the cache and
# is partly refused, so every panel has something to show.
LOADED_SIM = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "20",
    "--sim-step-per-token-ms",
    "0.05",
    "--max-num-seqs",
    "8",
    "--num-kv-blocks",
    "120",
    "--max-concurrent-requests",
    "12",
]


@pytest.fixture(scope="module")
def load_server() -> Iterator[ServerProcess]:
    server = start_server(LOADED_SIM, "web-load")
    yield server
    server.stop()


def stat(page: Page, name: str) -> str:
    return page.text_content(f"[data-testid=stat-{name}]") or ""


def polls(page: Page) -> int:
    return int(page.get_attribute("[data-testid=dashboard]", "data-polls") or 0)


def test_dashboard_follows_the_load(page: Page, load_server: ServerProcess) -> None:
    page.goto(load_server.base_url + "/#dashboard")
    assert page.is_visible("[data-testid=dashboard]")
    assert page.is_hidden("[data-testid=playground]")
    wait_until(lambda: stat(page, "running") == "0", "the idle server is shown")

    with StreamingLoad(load_server.base_url, MODEL, num_clients=14, max_tokens=200) as load:
        wait_until(lambda: int(stat(page, "running") or 0) > 0, "running requests show up")
        wait_until(lambda: int(stat(page, "waiting") or 0) > 0, "waiting requests show up")
        wait_until(lambda: float(stat(page, "rejections") or 0) > 0, "rejections show up")

        # Polled once a second, without reloading: the numbers keep changing.
        seen: set[tuple[str, ...]] = set()
        first_poll = polls(page)
        started = time.monotonic()
        while time.monotonic() - started < 3.5:
            seen.add(tuple(stat(page, n) for n in ("running", "kv", "rejections", "steps")))
            time.sleep(0.1)
        assert polls(page) >= first_poll + 2  # 3 expected; one of slack for a slow machine
        assert len(seen) >= 3, seen

        for chart in ("requests", "kv", "rejections", "steps"):
            assert page.is_visible(f"[data-testid=chart-{chart}]"), chart
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=ARTIFACTS / "dashboard.png", full_page=True)
    assert load.completed > 0 and load.errors == []

    wait_until(lambda: stat(page, "running") == "0", "the end of the load is shown", timeout=20)


FULL_SNAPSHOT: dict[str, Any] = {
    "ready": True,
    "model": MODEL,
    "requests_running": 5,
    "requests_waiting": 3,
    "requests_paused": 1,
    "streams_paused": 1,
    "kv_cache": {"usage_ratio": 0.5, "used_blocks": 60, "total_blocks": 120},
    "batch_size": 6,
    "ttft_seconds": {"p50": 0.12, "p99": 0.48},
    "tpot_seconds": {"p50": 0.021, "p99": 0.035},
    "queue_wait_seconds": {"p50": 0.5, "p95": 1.5, "p99": 2.5},
    "rejections_by_reason": {"concurrency": 4, "queue_full": 1},
    "breaker_state": "shed_batch",
    "preemptions_total": 2,
    "preemptions_by_reason": {"kv_pressure": 2},
    "engine_steps_total": 1000,
    "prefix_cache": {"hit_rate": 0.25, "cached_slots": 3, "hit_tokens": 1200},
    "speculation": {"acceptance_rate": 0.625, "proposed_tokens": 80, "accepted_tokens": 50},
    "prefill": {
        "tokens_by_phase": {
            "decode": {"interactive": 600, "batch": 200},
            "prefill": {"interactive": 150, "batch": 50},
        },
        "lanes": {"short": {"tokens": 100, "started": 4}, "long": {"tokens": 100, "started": 1}},
    },
}


def test_dashboard_shows_what_the_server_reports(page: Page, load_server: ServerProcess) -> None:
    """Fields a server does not report are skipped; newer fields appear when they exist."""
    snapshot: dict[str, Any] = {"ready": True, "model": MODEL, "requests_running": 2}

    def answer(route: Route) -> None:
        route.fulfill(status=200, content_type="application/json", body=orjson.dumps(snapshot))

    page.route("**/v1/stats", answer)
    page.goto(load_server.base_url + "/#dashboard")
    wait_until(lambda: stat(page, "running") == "2", "the running count is shown")
    assert page.is_hidden("[data-testid=stat-ttft]")
    assert page.is_hidden("[data-testid=chart-ttft]")
    assert page.is_hidden("[data-testid=stat-breaker]")
    assert page.is_hidden("[data-testid=stat-prefix]")
    assert page.is_hidden("[data-testid=stat-speculation]")
    assert page.is_hidden("[data-testid=stat-prefill]")

    snapshot = FULL_SNAPSHOT
    wait_until(lambda: stat(page, "running") == "5", "the next poll is shown")
    assert stat(page, "ttft") == "120 ms"
    assert page.locator("[data-testid=stat-ttft] + .sub").text_content() == "p99 480 ms"
    assert stat(page, "tpot") == "21 ms"
    assert stat(page, "batch") == "6"
    assert stat(page, "kv") == "50%"
    assert stat(page, "prefix") == "25%"
    assert page.locator("[data-testid=stat-prefix] + .sub").text_content() == (
        "of prompt tokens · 3 cached slots"
    )
    assert stat(page, "speculation") == "63%"
    assert page.locator("[data-testid=stat-speculation] + .sub").text_content() == (
        "50 of 80 drafted"
    )
    # Stall-free prefill's split: 200 prompt tokens of 1,000, half of them long prompts.
    assert stat(page, "prefill") == "20%"
    assert page.locator("[data-testid=stat-prefill] + .sub").text_content() == (
        "of tokens · 50% long prompts · 25% batch"
    )
    assert stat(page, "rejections") == "5"
    assert stat(page, "breaker") == "shed batch"
    charts = ("requests", "batch", "kv", "ttft", "tpot", "queue-wait", "rejections", "preemptions")
    for chart in charts:
        assert page.is_visible(f"[data-testid=chart-{chart}]"), chart
