"""Two replicas sharing one real Redis: crash and drain take-overs, shared rate limits."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pytest

from tests.resume.conftest import (
    MODEL,
    SIM,
    Received,
    assert_continues,
    chat_body,
    completion_body,
    config_file,
    kill,
    read_stream,
    resume,
    servers,
)
from tests.simtext import expected_chat, expected_completion
from tests.support import plain_http
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

#: The shared tenant's requests: a burst of five, refilled at one every 100 s, so none
#: while the test runs (docs/testing.md).  Two replicas' buckets refilling together are
#: tested on the store (tests/store/test_buckets.py).
BURST = 5
TENANTS = [
    {"name": "open", "api_key": "k-open"},
    {
        "name": "shared-rl",
        "api_key": "k-shared",
        "requests_per_second": 0.01,
        "request_burst": BURST,
    },
]
OPEN = {"authorization": "Bearer k-open"}


def replica_args(redis_url: str, config: str, *extra: str) -> list[str]:
    return [
        *SIM,
        "--store",
        f"{redis_url}/1",
        "--config",
        config,
        "--flush-interval-ms",
        "0",
        "--lease-ttl-seconds",
        "1",
        "--detached-grace-seconds",
        "0.5",
        *extra,
    ]


#: A pipeline whose guard never trips and whose format wraps the answer.
PIPELINES = [
    {
        "name": "wrapped",
        "stages": [
            {
                "guard": {
                    "window_tokens": 8,
                    "stride_tokens": 4,
                    "checks": [{"type": "regex", "patterns": ["never-in-sim-text"]}],
                }
            },
            {"format": {"prefix": "<<", "suffix": ">>"}},
        ],
    }
]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    settings = {"tenants": TENANTS, "pipelines": PIPELINES}
    return config_file(tmp_path_factory.mktemp("replicas"), "replicas", settings)


@dataclass
class Replicas:
    """The module's replicas, all sharing one Redis, started together."""

    a: ServerProcess
    b: ServerProcess
    #: Killed by the test that takes it.
    doomed: ServerProcess
    #: Drained (SIGTERM, a grace of 1 s) by the test that takes it.
    draining: ServerProcess


@pytest.fixture(scope="module")
def replicas(redis_url: str, config: str) -> Iterator[Replicas]:
    args = replica_args(redis_url, config)
    draining = replica_args(redis_url, config, "--drain-grace-seconds", "1")
    with servers(
        (args, "replica-a"), (args, "replica-b"), (args, "doomed"), (draining, "draining")
    ) as started:
        yield Replicas(*started)


@pytest.fixture(scope="module")
def pair(replicas: Replicas) -> tuple[ServerProcess, ServerProcess]:
    """Two replicas that no test stops."""
    return replicas.a, replicas.b


def test_sigkill_mid_stream_then_resume_on_another_replica(replicas: Replicas) -> None:
    a, b = replicas.doomed, replicas.b
    n = 300  # 1.2 s on replica A: over a second of it left when it is killed
    body = completion_body("crash me", 21, n)
    first = read_stream(
        "POST", a.v1 + "/completions", json=body, headers=OPEN, stop_after_events=40
    )
    kill(a)
    started = time.monotonic()
    sid = first.headers["x-sluicegate-stream-id"]
    rest = resume(b, sid, first.last_event_id, headers=OPEN)
    # B waited for A's lease to expire (1 s), then re-prefilled and went on: not for
    # ever (30 s: far above any machine's re-prefill, far below a hang).
    assert time.monotonic() - started < 30
    assert first.text + rest.text == expected_completion("crash me", 21, n)
    assert_continues(first, rest)
    metrics = plain_http.get(b.base_url + "/metrics", timeout=5).text
    assert 'sluicegate_stream_resumes_total{status="follow"} 1.0' in metrics


def test_client_reconnects_to_another_replica_while_the_first_still_runs(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = pair
    n = 400
    body = completion_body("moved", 4, n)
    first = read_stream(
        "POST", a.v1 + "/completions", json=body, headers=OPEN, stop_after_events=10
    )
    # B relays A's log, then continues the stream once A gives it up (its grace).
    rest = resume(b, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=OPEN)
    assert first.text + rest.text == expected_completion("moved", 4, n)
    assert_continues(first, rest)


def test_a_pipeline_stream_moves_to_another_replica_through_its_stages(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    """The replica that takes the stream over rebuilds its stages: what the guard held
    back (never logged) is regenerated, and the prefix is not sent twice."""
    a, b = pair
    n = 400
    body = {**chat_body("moved through stages", 8, n), "model": "wrapped"}
    first = read_stream(
        "POST", a.v1 + "/chat/completions", json=body, headers=OPEN, stop_after_events=10
    )
    rest = resume(b, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=OPEN)
    messages = [{"role": "user", "content": "moved through stages"}]
    assert first.text + rest.text == "<<" + expected_chat(messages, 8, n) + ">>"
    assert_continues(first, rest)


def test_sigterm_drain_checkpoints_the_rest_for_another_replica(replicas: Replicas) -> None:
    a, b = replicas.draining, replicas.b
    # At 4 ms a step, ~350 tokens fit the 0.4 s before SIGTERM plus the 1 s grace.
    lengths = [30, 40, 50, 60, 80, 700, 750, 800, 850, 900]
    results: dict[int, Received] = {}
    resumed: dict[int, Received] = {}

    started = threading.Semaphore(0)

    def run(i: int) -> None:
        body = completion_body(f"drain {i}", 100 + i, lengths[i])
        results[i] = read_stream(
            "POST", a.v1 + "/completions", json=body, headers=OPEN, on_response=started.release
        )

    def run_rest(i: int) -> None:
        got = results[i]
        sid = got.headers["x-sluicegate-stream-id"]
        resumed[i] = resume(b, sid, got.last_event_id, headers=OPEN)

    streams = start_threads(run, range(len(lengths)))
    for _ in lengths:  # every stream admitted before the drain starts
        assert started.acquire(timeout=10)
    a.process.send_signal(signal.SIGTERM)
    join(streams, 20)
    assert a.process.wait(10) == 0
    cut = [i for i, n in enumerate(lengths) if n > 100]
    for i, n in enumerate(lengths):
        got = results[i]
        if i not in cut:  # fits the grace period: completes on A
            assert got.done and got.text == expected_completion(f"drain {i}", 100 + i, n)
            continue
        notice = got.events[-2].error
        assert notice is not None and notice["type"] == "server_draining", i
        assert notice["stream_id"] == got.headers["x-sluicegate-stream-id"]
    join(start_threads(run_rest, cut), 30)
    for i in cut:
        expected = expected_completion(f"drain {i}", 100 + i, lengths[i])
        assert results[i].text + resumed[i].text == expected, i
        assert_continues(results[i], resumed[i])


def start_threads(target: Callable[[int], None], items: Iterable[int]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,)) for i in items]
    for thread in threads:
        thread.start()
    return threads


def join(threads: list[threading.Thread], timeout: float) -> None:
    for thread in threads:
        thread.join(timeout)


def test_rate_limit_is_shared_across_replicas(pair: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = pair
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    headers = {"authorization": "Bearer k-shared"}
    admitted = {a.v1: 0, b.v1: 0}
    with plain_http.client(timeout=10) as client:
        for _ in range(BURST):  # twice the burst, the replicas in turn
            for server in (a, b):
                response = client.post(server.v1 + "/completions", json=body, headers=headers)
                assert response.status_code in (200, 429), response.text
                admitted[server.v1] += response.status_code == 200
    # One bucket for both: the burst in all, where a bucket each would admit twice that.
    assert sum(admitted.values()) == BURST, admitted
    assert all(admitted.values()), admitted


def test_redis_unreachable_at_startup_is_a_clear_error() -> None:
    dead = "redis://127.0.0.1:1/0"
    done = subprocess.run(
        [sys.executable, "-m", "sluicegate", "serve", "--port", "0", *SIM, "--store", dead],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert "cannot reach the Redis store at redis://127.0.0.1:1/0" in done.stderr
