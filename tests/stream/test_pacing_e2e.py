"""Readers' pace through the real server over real sockets (sim engine): flow control
measures how fast a client with a backlog reads, QoE is reported per answer, and
``--scheduling qoe`` shows its policy and counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
ARGS = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "4",
    "--sim-step-per-token-ms",
    "0.01",
    "--max-num-seqs",
    "8",
    "--flush-interval-ms",
    "0",
    "--stall-timeout-seconds",
    "60",
    "--socket-send-buffer-bytes",
    "4096",
    "--transport-write-buffer-bytes",
    "4096",
    "--scheduling",
    "qoe",
    "--reading-tokens-per-second",
    "5",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(ARGS, "pacing")
    yield srv
    srv.stop()


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"reader {i}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def port_of(server: ServerProcess) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def test_a_clients_reading_pace_is_measured_from_its_socket(server: ServerProcess) -> None:
    stream = open_stream(
        "127.0.0.1",
        port_of(server),
        "/v1/chat/completions",
        body(1, 400),
        receive_buffer_bytes=4096,
    )
    events = stream.events(max_read_bytes=256)
    measured: float | None = None
    started = time.monotonic()
    read = 0
    try:
        # Read about 10 tokens a second (one token an event) for up to 8 s; the server
        # makes them far faster, so a backlog waits and the client's pace shows.
        while time.monotonic() - started < 8.0:
            event = next(events)
            if event_text(event):
                read += 1
            time.sleep(0.1)
            if read % 10 == 0:
                streams = server.stats()["streams"]
                measured = streams[0]["reader_tokens_per_second"] if streams else None
                if measured is not None and time.monotonic() - started > 5.0:
                    break
    finally:
        stream.close()
    assert measured is not None, "no pace was measured for a client with a backlog"
    assert 5.0 < measured < 15.0, measured


def test_qoe_is_reported_per_answer_and_the_policy_in_stats(server: ServerProcess) -> None:
    for i in range(3):  # fast readers: every token long before a reader needs it
        with httpx.stream(
            "POST", server.v1 + "/chat/completions", json=body(10 + i, 20), timeout=10
        ) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                pass
    stats = server.stats()
    assert stats["scheduling"]["policy"] == "qoe"
    assert stats["scheduling"]["reading_tokens_per_second"] == 5.0
    assert {"yields", "yielded_sequence_steps", "lead_seconds"} <= set(stats["scheduling"])
    qoe = stats["qoe"]
    assert qoe["count"] >= 3 and qoe["mean"] == 1.0 and qoe["p10"] == 1.0
    metrics = httpx.get(server.base_url + "/metrics", timeout=5).text
    count = next(line for line in metrics.splitlines() if line.startswith("sluicegate_qoe_count"))
    assert float(count.split()[-1]) >= 3
