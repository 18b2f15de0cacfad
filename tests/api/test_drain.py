"""Graceful drain on SIGTERM: finish what fits, refuse new work, tell the rest to resume."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.support.servers import start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


def test_sigterm_drains_then_exits_zero() -> None:
    srv = start_server(
        ["--engine", "sim", "--sim-step-base-ms", "10", "--drain-grace-seconds", "1.5"], "drain"
    )
    results: dict[str, Any] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {
            "model": MODEL,
            "prompt": name,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", srv.v1 + "/completions", json=body, timeout=30) as resp:
            results[name] = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]

    short = threading.Thread(target=stream, args=("short", 50))  # ~0.5 s: fits the grace
    long = threading.Thread(target=stream, args=("long", 2000))  # ~20 s: does not
    short.start()
    long.start()
    time.sleep(0.3)
    srv.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(srv.v1 + "/completions", json={"model": MODEL, "prompt": "new"}, timeout=5)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_draining"
    assert "retry-after" in refused.headers
    assert httpx.get(srv.base_url + "/ready", timeout=5).status_code == 503
    short.join(10)
    long.join(10)
    assert srv.process.wait(10) == 0
    finish = [orjson.loads(ln[6:]) for ln in results["short"] if ln.startswith("data: {")]
    assert finish[-1]["choices"][0]["finish_reason"] == "length"
    last = [orjson.loads(ln[6:]) for ln in results["long"] if ln.startswith("data: {")][-1]
    assert last["error"]["type"] == "server_draining"
    assert last["error"]["stream_id"]
    assert results["long"][-1] == "data: [DONE]"
