"""Drop a connection, resume with Last-Event-ID: the same text as an unbroken stream."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.resume.conftest import (
    SIM,
    assert_continues,
    chat_body,
    completion_body,
    owner,
    read_stream,
    resume,
    servers,
)
from tests.simtext import expected_chat, expected_completion
from tests.support import plain_http
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

STORES = ["memory", "redis"]
#: 2 ms steps: a 200-token stream runs 0.4 s, still under way when its client drops
#: after its first events (and a resume gives the same text whether it follows the
#: stream or replays its finished log).
FAST = [*SIM, "--sim-step-base-ms", "2"]


@pytest.fixture(scope="module")
def started(redis_url: str) -> Iterator[dict[str, ServerProcess]]:
    """The module's servers, started together: one per store, a detached stream kept 5 s,
    and ``grace``, which stops a detached stream after 0.3 s."""
    kept = ["--flush-interval-ms", "0", "--detached-grace-seconds", "5"]
    with servers(
        ([*FAST, "--store", "memory", *kept], "resume-memory"),
        ([*FAST, "--store", redis_url, *kept], "resume-redis"),
        ([*FAST, "--flush-interval-ms", "0", "--detached-grace-seconds", "0.3"], "grace"),
    ) as (memory, redis, grace):
        yield {"memory": memory, "redis": redis, "grace": grace}


@pytest.fixture(params=STORES)
def server(request: pytest.FixtureRequest, started: dict[str, ServerProcess]) -> ServerProcess:
    return started[request.param]


def test_every_event_has_an_id_and_the_stream_id_is_the_chunk_id(server: ServerProcess) -> None:
    got = read_stream("POST", server.v1 + "/completions", json=completion_body("ids", 1, 40))
    stream_id = got.headers["x-sluicegate-stream-id"]
    assert got.headers["x-request-id"] == stream_id
    assert len(stream_id) >= 32
    chunks = [e for e in got.events if e.json is not None]
    assert all(e.event_id is not None and e.event_id.startswith(stream_id + ":") for e in chunks)
    assert all(e.json is not None and e.json["id"] == stream_id for e in chunks)
    assert got.seqs == sorted(set(got.seqs)) and got.seqs[0] == 1
    assert got.text == expected_completion("ids", 1, 40) and got.done


@pytest.mark.parametrize("cut_after", [1, 40])
def test_drop_and_resume_gives_the_uninterrupted_text(
    server: ServerProcess, cut_after: int
) -> None:
    # Multi-byte characters (水門, σήμα, 🌊) are split over byte tokens in the sim engine.
    n = 200
    body = completion_body("resume me", 7, n)
    first = read_stream("POST", server.v1 + "/completions", json=body, stop_after_events=cut_after)
    assert not first.done
    rest = resume(
        server, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=owner(first)
    )
    assert rest.status == 200
    assert first.text + rest.text == expected_completion("resume me", 7, n)
    assert_continues(first, rest)


def test_a_detached_stream_pauses_at_the_high_water_mark(server: ServerProcess) -> None:
    n = 300
    body = completion_body("paused while away", 8, n)
    first = read_stream("POST", server.v1 + "/completions", json=body, stop_after_events=5)
    deadline = time.monotonic() + 30
    while not plain_http.stats(server)["requests_paused"] and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = plain_http.stats(server)
    assert stats["requests_paused"] == 1 and stats["streams_paused"] == 1
    streams: list[dict[str, int]] = stats["streams"]  # type: ignore[assignment]
    assert len(streams) == 1
    produced = streams[0]["tokens_produced"]
    assert 128 <= produced < n  # the high-water mark (128 tokens nobody received)
    time.sleep(0.2)
    assert plain_http.stats(server)["streams"][0]["tokens_produced"] == produced  # type: ignore[index]
    rest = resume(
        server, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=owner(first)
    )
    assert first.text + rest.text == expected_completion("paused while away", 8, n)
    assert_continues(first, rest)
    assert plain_http.stats(server)["streams_paused"] == 0


def test_chat_stream_resumes_after_the_role_chunk(server: ServerProcess) -> None:
    n = 120
    body = chat_body("a chat to resume", 11, n, stream_options={"include_usage": True})
    first = read_stream("POST", server.v1 + "/chat/completions", json=body, stop_after_events=3)
    assert first.events[0].json is not None
    assert first.events[0].json["choices"][0]["delta"]["role"] == "assistant"
    rest = resume(
        server, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=owner(first)
    )
    messages = body["messages"]
    assert first.text + rest.text == expected_chat(messages, 11, n)
    assert_continues(first, rest)
    usage = [e.json["usage"] for e in rest.events if e.json and not e.json["choices"]]
    assert usage and usage[0]["completion_tokens"] == n


@pytest.mark.parametrize("stop", ["日本", "🌊", "the river"])
def test_stop_strings_across_a_resume(server: ServerProcess, stop: str) -> None:
    n = 400
    full = expected_completion("resume me", 7, n)
    assert stop in full
    body = completion_body("resume me", 7, n, stop=[stop])
    first = read_stream("POST", server.v1 + "/completions", json=body, stop_after_events=20)
    rest = resume(
        server, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=owner(first)
    )
    assert first.text + rest.text == full[: full.index(stop)]
    finish = [e.json for e in rest.events if e.json and e.json["choices"]]
    assert finish[-1]["choices"][0]["finish_reason"] == "stop"
    assert_continues(first, rest)


def test_after_query_parameter_and_replay_of_a_finished_stream(server: ServerProcess) -> None:
    got = read_stream("POST", server.v1 + "/completions", json=completion_body("done", 3, 50))
    stream_id = got.headers["x-sluicegate-stream-id"]
    mine = owner(got)
    whole = read_stream("GET", f"{server.v1}/streams/{stream_id}", headers=mine)
    assert whole.text == got.text and whole.seqs == got.seqs and whole.done
    tail = read_stream("GET", f"{server.v1}/streams/{stream_id}?after=2", headers=mine)
    assert tail.seqs == got.seqs[2:] and whole.text.endswith(tail.text)
    nothing = read_stream(
        "GET", f"{server.v1}/streams/{stream_id}?after={got.seqs[-1]}", headers=mine
    )
    assert nothing.status == 200 and nothing.events == []
    beyond = plain_http.get(f"{server.v1}/streams/{stream_id}?after=999", headers=mine, timeout=5)
    assert beyond.status_code == 400 and "last event is seq" in beyond.json()["error"]["message"]
    other = plain_http.get(
        f"{server.v1}/streams/{stream_id}",
        headers={**mine, "last-event-id": "cmpl-other:3"},
        timeout=5,
    )
    assert other.status_code == 400 and other.json()["error"]["param"] == "Last-Event-ID"


def test_a_stream_left_alone_past_the_grace_is_stopped_and_still_resumable(
    started: dict[str, ServerProcess],
) -> None:
    srv = started["grace"]
    n = 300  # far from done when the grace runs out (it pauses at 128 tokens anyway)
    body = completion_body("left alone", 5, n)
    first = read_stream("POST", srv.v1 + "/completions", json=body, stop_after_events=5)
    deadline = time.monotonic() + 30
    while plain_http.stats(srv)["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = plain_http.stats(srv)
    assert stats["requests_running"] == 0 and stats["live_requests"] == 0
    metrics = plain_http.get(srv.base_url + "/metrics", timeout=5).text
    assert 'sluicegate_streams_checkpointed_total{reason="detached"} 1.0' in metrics
    rest = resume(
        srv, first.headers["x-sluicegate-stream-id"], first.last_event_id, headers=owner(first)
    )
    assert first.text + rest.text == expected_completion("left alone", 5, n)
    assert_continues(first, rest)
