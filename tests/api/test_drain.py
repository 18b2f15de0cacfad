"""Graceful drain on SIGTERM: finish what fits, refuse new work, tell the rest to resume.

A real server process: the point is the signal and the process's exit."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


def wait_for(condition: Any, what: str, within_seconds: float = 30.0) -> None:
    """Poll until ``condition()`` holds; the deadline only a broken server misses."""
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def running(srv: ServerProcess) -> int:
    return int(srv.stats()["requests_running"])


def test_sigterm_drains_then_exits_zero() -> None:
    # The short stream's 20 tokens at 20 a second take at least 0.95 s (it is still
    # running when the signal comes) and fit in the 3 s of grace; the long one's 2000 at
    # 10 ms a step need 20 s and cannot finish.
    srv = start_server(
        ["--engine", "sim", "--sim-step-base-ms", "10", "--drain-grace-seconds", "3"], "drain"
    )
    results: dict[str, Any] = {}

    def stream(name: str, max_tokens: int, **pace: float) -> None:
        body = {
            "model": MODEL,
            "prompt": name,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            **pace,
        }
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as resp:
            results[name] = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]

    short = threading.Thread(
        target=stream, args=("short", 20), kwargs={"max_tokens_per_second": 20}
    )
    long = threading.Thread(target=stream, args=("long", 2000))
    long.start()
    wait_for(lambda: running(srv) == 1, "the long stream to run")
    short.start()
    wait_for(lambda: running(srv) == 2, "both streams to run")
    srv.process.send_signal(signal.SIGTERM)
    wait_for(
        lambda: httpx.get(srv.base_url + "/ready", timeout=5).status_code == 503,
        "the server to say it is draining",
    )
    refused = httpx.post(srv.v1 + "/completions", json={"model": MODEL, "prompt": "new"}, timeout=5)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_draining"
    assert "retry-after" in refused.headers
    short.join(30)
    long.join(30)
    assert srv.process.wait(30) == 0
    finish = [orjson.loads(ln[6:]) for ln in results["short"] if ln.startswith("data: {")]
    assert finish[-1]["choices"][0]["finish_reason"] == "length"
    last = [orjson.loads(ln[6:]) for ln in results["long"] if ln.startswith("data: {")][-1]
    assert last["error"]["type"] == "server_draining"
    assert last["error"]["stream_id"]
    assert results["long"][-1] == "data: [DONE]"
