"""Flow control through the real server over real sockets (sim engine)."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from tests.simtext import expected_chat
from tests.support.servers import ServerProcess, cancellations, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
FLOW_ARGS = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "4",
    "--sim-step-per-token-ms",
    "0.01",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "4096",
    "--high-water-tokens",
    "32",
    "--low-water-tokens",
    "8",
    "--flush-interval-ms",
    "0",
    "--stall-timeout-seconds",
    "60",
    "--socket-send-buffer-bytes",
    "4096",
    "--transport-write-buffer-bytes",
    "4096",
    # Speculative decoding on (the sim's default is off): a stream gains several tokens
    # in one step, through pauses, preemption and resume.
    "--speculative-tokens",
    "8",
]


@pytest.fixture(scope="module")
def flow_server() -> Iterator[ServerProcess]:
    server = start_server([*FLOW_ARGS, "--pause-preempt-seconds", "1.0"], "flow")
    yield server
    server.stop()


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"reader {i}"}],
        "max_tokens": max_tokens,
        "seed": 500 + i,
        "ignore_eos": True,
        "stream": True,
    }


def port_of(server: ServerProcess) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def fast_stream_gaps(server: ServerProcess, i: int, n: int) -> list[float]:
    """Read one normal stream; return its inter-event gaps."""
    stream = open_stream("127.0.0.1", port_of(server), "/v1/chat/completions", body(i, n))
    times = [e.received_at for e in stream.events() if event_text(e)]
    stream.close()
    return [b - a for a, b in itertools.pairwise(times)]


def test_slow_reader_is_paused_and_others_keep_their_pace(flow_server: ServerProcess) -> None:
    cancelled_before = cancellations(flow_server)
    # Baseline pace of normal streams, alone.
    baseline = statistics.median(fast_stream_gaps(flow_server, 1, 150))

    slow = open_stream(
        "127.0.0.1",
        port_of(flow_server),
        "/v1/chat/completions",
        body(2, 3000),
        receive_buffer_bytes=4096,
    )
    events = slow.events(max_read_bytes=256)
    for _ in range(3):
        next(events)  # read a little, then stop reading entirely

    def paused() -> dict[str, Any] | None:
        stats: dict[str, Any] = flow_server.stats()
        return stats if stats["requests_paused"] == 1 and stats["streams_paused"] == 1 else None

    stats = wait_for(paused, 10.0, "the slow reader's sequence to pause")
    metrics = httpx.get(flow_server.base_url + "/metrics", timeout=5).text
    assert 'sluicegate_streams_paused{stage="client"} 1.0' in metrics
    assert 'sluicegate_stream_pauses_total{stage="client"}' in metrics
    slow_info = stats["streams"][0]
    # Paused: production stopped close to the high-water mark (one step of lag at most).
    produced = slow_info["tokens_produced"]
    time.sleep(0.5)
    after = flow_server.stats()["streams"][0]
    assert after["tokens_produced"] == produced, "a paused sequence must not decode"
    assert after["buffered_tokens"] <= 32 + 1

    # Meanwhile other streams run at their normal pace.
    gaps: list[float] = []
    threads = [
        threading.Thread(target=lambda i=i: gaps.extend(fast_stream_gaps(flow_server, 10 + i, 100)))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with_slow = statistics.median(gaps)
    assert with_slow < baseline * 1.5 + 0.002, (baseline, with_slow)
    slow.close()
    # Paused past --pause-preempt-seconds, the slow sequence may already be preempted (not
    # running); the close detaches its stream, which is cancelled after the detached grace.
    wait_for(lambda: flow_server.stats()["live_requests"] == 0, 5.0, "abort after close")
    assert flow_server.stats()["requests_running"] == 0
    assert cancellations(flow_server) - cancelled_before == 1


def test_resume_after_pause_and_preemption_gives_identical_text(flow_server: ServerProcess) -> None:
    n = 400
    b = body(3, n)
    expected = expected_chat(b["messages"], b["seed"], n)
    before = flow_server.stats()["preemptions_by_reason"].get("long_pause", 0)
    stream = open_stream(
        "127.0.0.1", port_of(flow_server), "/v1/chat/completions", b, receive_buffer_bytes=4096
    )
    events = stream.events(max_read_bytes=256)
    text = ""
    for event in events:
        text += event_text(event) or ""
        if len(text) > 10:
            break
    # Stop reading long enough to be paused and then preempted (pause_preempt 1 s).
    wait_for(
        lambda: flow_server.stats()["preemptions_by_reason"].get("long_pause", 0) > before,
        10.0,
        "long-pause preemption",
    )
    assert flow_server.stats()["kv_cache"]["used_blocks"] == 0  # its KV was freed
    for event in events:  # catch up: resume, re-prefill, continue
        text += event_text(event) or ""
    stream.close()
    assert text == expected
    speculation = flow_server.stats()["speculation"]
    assert speculation["accepted_tokens"] > 0  # several tokens a step, and still identical


def test_stalled_client_is_evicted_with_a_final_error_event() -> None:
    server = start_server([*FLOW_ARGS, "--stall-timeout-seconds", "1"], "stall")
    try:
        stream = open_stream(
            "127.0.0.1",
            port_of(server),
            "/v1/chat/completions",
            body(4, 3000),
            receive_buffer_bytes=4096,
        )
        events = stream.events(max_read_bytes=256)
        next(events)
        wait_for(
            lambda: (
                "sluicegate_streams_evicted_total 1.0"
                in httpx.get(server.base_url + "/metrics", timeout=5).text
            ),
            10.0,
            "eviction",
        )
        assert server.stats()["requests_running"] == 0
        tail = [e.data for e in events]  # drain what the server sent before closing
        errors = [orjson.loads(d[6:]) for d in tail if d.startswith(b'data: {"error"')]
        assert errors and errors[-1]["error"]["type"] == "stream_stalled"
        assert tail[-1] == b"data: [DONE]"
        stream.close()
    finally:
        server.stop()


def test_chunking_reduces_writes_and_zero_means_every_token(sim_server: ServerProcess) -> None:
    port = port_of(sim_server)

    def count(options: dict[str, Any]) -> tuple[int, str, float, float]:
        b = {**body(5, 200), "stream_options": options}
        started = time.monotonic()
        stream = open_stream("127.0.0.1", port, "/v1/chat/completions", b)
        texts = [(event_text(e), e.received_at) for e in stream.events()]
        stream.close()
        content = [(t, at) for t, at in texts if t]
        return len(content), "".join(t for t, _ in content), content[0][1] - started, started

    every, text_every, first_every, _ = count({"flush_interval_ms": 0})
    chunked, text_chunked, first_chunked, _ = count(
        {"flush_interval_ms": 40, "flush_max_tokens": 1000}
    )
    assert text_every == text_chunked
    # Every token its own event (a multi-byte character's bytes share one event).
    assert every == len(text_every)
    assert chunked <= every / 4
    # The first token is flushed at once, not after a chunk interval.
    assert first_chunked < 0.040 + first_every


def test_queued_work_takes_a_paused_readers_place() -> None:
    # One sequence slot and a long preemption delay: without handing the paused
    # sequence's slot over, the second request would wait 30 s.
    server = start_server(
        [
            *FLOW_ARGS,
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "64",
            "--pause-preempt-seconds",
            "30",
        ],
        "slot-handover",
    )
    try:
        slow = open_stream(
            "127.0.0.1",
            port_of(server),
            "/v1/chat/completions",
            body(6, 3000),
            receive_buffer_bytes=4096,
        )
        next(slow.events(max_read_bytes=256))
        wait_for(lambda: server.stats()["streams_paused"] == 1, 10.0, "the slow reader's pause")
        started = time.monotonic()
        r = httpx.post(
            server.v1 + "/completions",
            json={"model": MODEL, "prompt": "next", "max_tokens": 20, "ignore_eos": True},
            timeout=20,
        )
        assert r.status_code == 200
        assert time.monotonic() - started < 10
        assert server.stats()["preemptions_by_reason"].get("kv_pressure", 0) >= 1
        slow.close()
    finally:
        server.stop()
