"""Flow control through the real server over real sockets (sim engine)."""

from __future__ import annotations

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

# Its tests share a server: under pytest-xdist (make test) they run on one worker, which
# starts it once.
pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
HIGH_WATER_TOKENS = 32
#: How far production may run past the high-water mark before the pause takes hold.  The
#: event loop that asks for the pause may be some steps behind the engine thread on a
#: loaded machine: 25 steps (100 ms at 4 ms a step), each of at most 1 + 8 tokens (the
#: speculative ones).  Still a small part of the 3,000-token answer.
PAUSE_LAG_TOKENS = 25 * 9
#: Only a broken server takes this long to pause, preempt, evict or end a stream.
DEADLINE_SECONDS = 30.0
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
    str(HIGH_WATER_TOKENS),
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
    # No test here is about shutdown: a stop does not wait for streams left open.
    "--drain-grace-seconds",
    "0",
]


@pytest.fixture(scope="module")
def flow_server() -> Iterator[ServerProcess]:
    # A closed stream is cancelled at once (no grace for a reconnect: none comes here).
    server = start_server(
        [*FLOW_ARGS, "--pause-preempt-seconds", "1.0", "--detached-grace-seconds", "0"], "flow"
    )
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


def read_whole_stream(server: ServerProcess, i: int, n: int) -> str:
    """Read one normal stream to its end; return its text."""
    stream = open_stream("127.0.0.1", port_of(server), "/v1/chat/completions", body(i, n))
    text = "".join(event_text(e) or "" for e in stream.events())
    stream.close()
    return text


def test_slow_reader_is_paused_and_the_others_run_meanwhile(flow_server: ServerProcess) -> None:
    cancelled_before = cancellations(flow_server)
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

    stats = wait_for(paused, DEADLINE_SECONDS, "the slow reader's sequence to pause")
    metrics = httpx.get(flow_server.base_url + "/metrics", timeout=DEADLINE_SECONDS).text
    assert 'sluicegate_streams_paused{stage="client"} 1.0' in metrics
    assert 'sluicegate_stream_pauses_total{stage="client"}' in metrics
    (slow_info,) = [s for s in stats["streams"] if s["paused"]]
    # Paused: production stopped near the high-water mark, not at the answer's end.
    assert slow_info["buffered_tokens"] <= HIGH_WATER_TOKENS + PAUSE_LAG_TOKENS, slow_info
    produced = slow_info["tokens_produced"]

    # Meanwhile other streams run to their end, their text exact.
    texts: dict[int, str] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: texts.update({i: read_whole_stream(flow_server, i, 100)})
        )
        for i in range(10, 14)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_SECONDS)
    for i in range(10, 14):
        b = body(i, 100)
        assert texts.get(i) == expected_chat(b["messages"], b["seed"], 100), i
    # ... and the paused sequence decoded nothing in any of their steps: it costs them
    # nothing, which is why they keep their pace (the pace itself is the bench's to
    # measure; the step cost of a batch, the scheduler's tests').
    (after,) = [s for s in flow_server.stats()["streams"] if s["paused"]]
    assert after["tokens_produced"] == produced, "a paused sequence must not decode"
    slow.close()
    # Paused past --pause-preempt-seconds, the slow sequence may already be preempted (not
    # running); the close detaches its stream, which is cancelled (no detached grace).
    wait_for(
        lambda: flow_server.stats()["live_requests"] == 0, DEADLINE_SECONDS, "abort after close"
    )
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
        DEADLINE_SECONDS,
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
                in httpx.get(server.base_url + "/metrics", timeout=DEADLINE_SECONDS).text
            ),
            DEADLINE_SECONDS,
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

    def count(options: dict[str, Any]) -> tuple[int, str, float]:
        b = {**body(5, 200), "stream_options": options}
        started = time.monotonic()
        stream = open_stream("127.0.0.1", port, "/v1/chat/completions", b)
        texts = [(event_text(e), e.received_at) for e in stream.events()]
        stream.close()
        content = [(t, at) for t, at in texts if t]
        return len(content), "".join(t for t, _ in content), content[0][1] - started

    every, text_every, first_every = count({"flush_interval_ms": 0})
    # Chunks of at least 50 tokens (or one a second, the longest interval allowed): five
    # at most, however fast the tokens come, unless the answer took 45 s.
    chunked, text_chunked, first_chunked = count(
        {"flush_interval_ms": 1000, "flush_max_tokens": 50}
    )
    assert text_every == text_chunked
    # Every token its own event (a multi-byte character's bytes share one event).
    assert every == len(text_every)
    assert chunked <= every / 4
    # The first token is flushed at once, not after a chunk interval: had it waited one,
    # it would have come a second later than without chunks (measured just before).
    assert first_chunked < first_every + 1.0, (first_chunked, first_every)


def test_queued_work_takes_a_paused_readers_place() -> None:
    # One sequence slot and a preemption delay longer than any test: without handing the
    # paused sequence's slot over, the second request would wait for ever.
    server = start_server(
        [
            *FLOW_ARGS,
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "64",
            "--pause-preempt-seconds",
            "600",
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
        wait_for(
            lambda: server.stats()["streams_paused"] == 1,
            DEADLINE_SECONDS,
            "the slow reader's pause",
        )
        r = httpx.post(
            server.v1 + "/completions",
            json={"model": MODEL, "prompt": "next", "max_tokens": 20, "ignore_eos": True},
            timeout=DEADLINE_SECONDS,
        )
        assert r.status_code == 200
        # Its place was handed over (the paused sequence preempted for it), not freed by a
        # long pause (600 s) or an eviction (60 s).
        preemptions = server.stats()["preemptions_by_reason"]
        assert preemptions.get("kv_pressure", 0) >= 1, preemptions
        assert preemptions.get("long_pause", 0) == 0, preemptions
        slow.close()
    finally:
        server.stop()
