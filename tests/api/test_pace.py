"""``max_tokens_per_second`` through a real server: a floor on the pace, and slow paces
that cannot hold every seat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support.servers import start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"

SIM = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "2",
    "--sim-step-per-token-ms",
    "0",
    "--max-num-seqs",
    "4",
    "--max-queue-wait-seconds",
    "5",
    "--flush-interval-ms",
    "0",
]


def wait_for(condition: Callable[[], bool], within_seconds: float, what: str) -> None:
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_pace_below_the_floor_is_a_400_naming_the_floor() -> None:
    srv = start_server(SIM, "pace-floor")
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "max_tokens_per_second": 0.0001}
        refused = httpx.post(srv.v1 + "/completions", json=body, timeout=5)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "max_tokens_per_second" and error["code"] == "invalid_value"
        assert "at least 1 " in error["message"] and "0.0001" in error["message"]
        assert "pace_floor_tokens_per_second" in error["message"]
        fast_enough = {**body, "max_tokens_per_second": 1, "max_tokens": 2}
        assert httpx.post(srv.v1 + "/completions", json=fast_enough, timeout=5).status_code == 200
    finally:
        srv.stop()


def test_four_slow_streams_do_not_hold_the_four_seats() -> None:
    srv = start_server(SIM, "pace-seats")
    tokens: dict[int, dict[str, str]] = {}
    stop = threading.Event()

    def slow_stream(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"slow {i}",
            "max_tokens": 120,
            "ignore_eos": True,
            "stream": True,
            "max_tokens_per_second": 1,
        }
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as resp:
            tokens[i] = {
                "id": resp.headers["x-request-id"],
                "x-sluicegate-resume-token": resp.headers.get("x-sluicegate-resume-token", ""),
            }
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=slow_stream, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(tokens) == 4, 10, "four slow streams")
        wait_for(lambda: srv.stats()["requests_running"] == 4, 10, "four running sequences")
        time.sleep(0.2)  # each has had its token of slack and waits for its pace
        # Every seat is taken by a stream that waits a second per token: lent, not held.
        started = time.monotonic()
        fifth = httpx.post(
            srv.v1 + "/completions",
            json={"model": MODEL, "prompt": "next", "max_tokens": 30},
            timeout=10,
        )
        assert fifth.status_code == 200, fifth.text
        assert time.monotonic() - started < 3
        assert fifth.json()["usage"]["completion_tokens"] == 30
        assert srv.stats()["requests_throttled"] == 4
        # The slow streams went on at their pace meanwhile, and stop at once when cancelled.
        for owner in tokens.values():
            cancel = f"{srv.v1}/requests/{owner['id']}/cancel"
            assert httpx.post(cancel, headers=owner, timeout=5).status_code == 200
        wait_for(lambda: srv.stats()["requests_running"] == 0, 1.0, "the cancels to show")
        stats = srv.stats()
        assert stats["requests_throttled"] == 0 and stats["kv_cache"]["used_blocks"] == 0
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        srv.stop()
