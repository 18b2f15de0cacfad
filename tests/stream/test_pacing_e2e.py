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

# Its tests share a server: under pytest-xdist (make test) they run on one worker, which
# starts it once.
pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
#: Only a broken server takes this long to measure a pace or end a stream.
DEADLINE_SECONDS = 30.0
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
    # No test here is about shutdown: a stop does not wait for streams left open.
    "--drain-grace-seconds",
    "0",
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
        # Read one token an event, about 25 a second, until the server has measured the
        # pace (over windows of 2 s); it makes them ten times faster, so a backlog waits
        # and the client's pace shows.
        while measured is None:
            assert time.monotonic() - started < DEADLINE_SECONDS, "no pace was measured"
            event = next(events)
            if event_text(event):
                read += 1
            time.sleep(0.04)
            if read % 10 == 0:
                streams = server.stats()["streams"]
                measured = streams[0]["reader_tokens_per_second"] if streams else None
        client_pace = read / (time.monotonic() - started)
    finally:
        stream.close()
    # What the client read, measured by the client over the same time: on a loaded
    # machine both are slower together.  The server sees it through TCP's
    # acknowledgements, which come in bursts of a few kilobytes, hence the margin; the
    # server's own rate (250 tokens/s) and the configured 5 tokens/s are both outside it.
    assert client_pace / 2.5 < measured < client_pace * 2.5, (measured, client_pace)


def test_qoe_is_reported_per_answer_and_the_policy_in_stats(server: ServerProcess) -> None:
    for i in range(3):  # fast readers: every token long before a reader needs it
        with httpx.stream(
            "POST",
            server.v1 + "/chat/completions",
            json=body(10 + i, 20),
            timeout=DEADLINE_SECONDS,
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
    metrics = httpx.get(server.base_url + "/metrics", timeout=DEADLINE_SECONDS).text
    count = next(line for line in metrics.splitlines() if line.startswith("sluicegate_qoe_count"))
    assert float(count.split()[-1]) >= 3
