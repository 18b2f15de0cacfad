"""Two gateway replicas sharing one real Redis in front of one sim upstream of four
seats: what one holds there counts against the other's room, so together they never send
the upstream more than its seats (it would queue the rest inside itself, out of sight of
both); a replica whose places are all taken by the other queues its requests, and takes
a place as soon as the other lets it go."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.resume.conftest import redis_url as redis_url  # the session's Redis fixture
from tests.support.servers import ServerProcess, start_server, start_servers
from tests.upstream.conftest import SLOW_SIM

pytestmark = pytest.mark.slow

SEATS = 4


def gateway_args(upstream: ServerProcess, redis: str) -> list[str]:
    return [
        *("--engine", "upstream", "--upstream", upstream.base_url),
        *("--store", f"{redis}/5", "--upstream-tokenizer", "bytes", "--admission", "static"),
        *("--upstream-health-interval-seconds", "0.3", "--upstream-share-interval-seconds", "0.1"),
        *("--upstream-first-token-timeout-seconds", "60"),
    ]


@pytest.fixture(scope="module")
def pair(redis_url: str) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    # 40 ms a step: an answer of 100 tokens holds its seat for about 4 s.
    upstream = start_server(
        [
            *SLOW_SIM,
            "--max-num-seqs",
            str(SEATS),
            "--sim-step-base-ms",
            "40",
            "--admission",
            "static",
        ],
        "upstream-shared",
    )
    started = [upstream]
    try:
        started += start_servers(
            (gateway_args(upstream, redis_url), "gateway-shared-a"),
            (gateway_args(upstream, redis_url), "gateway-shared-b"),
        )
        yield upstream, started[1], started[2]
    finally:
        for server in started:
            server.stop()


def upstream_state(gateway: ServerProcess) -> dict[str, int]:
    (state,) = gateway.stats()["upstreams"].values()
    return state


def wait_for(what: str, ok: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def complete(gateway: ServerProcess, max_tokens: int, results: list[int]) -> None:
    body = {"model": "sluicegate-sim", "prompt": "shared pool", "max_tokens": max_tokens}
    body["ignore_eos"] = True
    response = httpx.post(gateway.v1 + "/completions", json=body, timeout=120)
    results.append(response.status_code)


def test_one_replicas_requests_leave_no_room_for_the_others(
    pair: tuple[ServerProcess, ServerProcess, ServerProcess],
) -> None:
    upstream, a, b = pair
    # Each replica has learned the upstream's seats (it reports them).
    wait_for(
        "the limits", lambda: upstream_state(a)["limit"] == upstream_state(b)["limit"] == SEATS
    )
    statuses: list[int] = []
    threads = [threading.Thread(target=complete, args=(a, 100, statuses)) for _ in range(SEATS)]
    for thread in threads:
        thread.start()
    wait_for("a holding every seat", lambda: upstream_state(a)["outstanding_requests"] == SEATS)
    wait_for("b seeing them", lambda: upstream_state(b)["held_elsewhere"] == SEATS)
    later = [threading.Thread(target=complete, args=(b, 4, statuses)) for _ in range(2)]
    for thread in later:
        thread.start()
    # b has no seat while a holds every place: its two wait in its own queue, where its
    # admission sees them (not inside the upstream, nor dispatched to wait for a place).
    assert b.stats()["seats"]["seat_limit"] == 0
    wait_for("b queueing its two", lambda: b.stats()["requests_waiting"] == 2)
    # While a's answers run, b sends the upstream nothing: its requests wait in b.  (b is
    # read first: a still full after it means a was full all along, as a takes no more.)
    most_running = 0
    while True:
        held_by_b = upstream_state(b)["outstanding_requests"]
        inside = upstream.stats()
        if upstream_state(a)["outstanding_requests"] < SEATS:
            break
        assert held_by_b == 0
        assert int(inside["requests_waiting"]) == 0
        most_running = max(most_running, int(inside["requests_running"]))
        time.sleep(0.1)
    assert most_running == SEATS
    for thread in threads + later:
        thread.join(timeout=120)
    assert statuses == [200] * (SEATS + 2)
    wait_for("a's places given back", lambda: upstream_state(b)["held_elsewhere"] == 0)
