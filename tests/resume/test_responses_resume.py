"""The Responses API's resumable background streams over real sockets, with the official
client unmodified: interrupted after N events and resumed with ``starting_after=N``, on
the same replica and on another one after the first was killed (one real Redis)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from sluicegate.bench.resume_latency import resume_latency
from tests.resume.conftest import SIM, config_file, kill, servers
from tests.support import plain_http
from tests.support.background import in_background
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

TENANTS = [{"name": "alpha", "api_key": "key-alpha"}]


def replica_args(redis_url: str, config: str, journal: Path) -> list[str]:
    return [
        *SIM,
        "--store",
        f"{redis_url}/3",
        "--config",
        config,
        "--flush-interval-ms",
        "0",
        # Three seconds, not one: on two cores busy with the rest of the suite a replica's
        # renewals (every third of it) were once late by more than a second, and it lost
        # the lease of the stream a test was reading to itself (a fresh clone's run).
        "--lease-ttl-seconds",
        "3",
        # Its own: a killed replica's jobs are not run again by the next server to start.
        "--journal-path",
        str(journal),
    ]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    return config_file(tmp_path_factory.mktemp("responses"), "tenants", {"tenants": TENANTS})


@dataclass
class Replicas:
    """The module's replicas, sharing one Redis, started together."""

    #: Lives through the module.
    replica: ServerProcess
    #: Killed mid-stream.
    doomed: ServerProcess
    #: Killed with a background response just created.
    doomed_polled: ServerProcess
    #: Runs the response another replica cancels.
    other: ServerProcess


@pytest.fixture(scope="module")
def replicas(
    redis_url: str, config: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    names = ["responses-b", "responses-doomed", "responses-doomed-2", "responses-a"]
    journals = tmp_path_factory.mktemp("journals")
    specs = [(replica_args(redis_url, config, journals / f"{n}.sqlite3"), n) for n in names]
    with servers(*specs) as started:
        yield Replicas(*started)


@pytest.fixture(scope="module")
def replica(replicas: Replicas) -> ServerProcess:
    return replicas.replica


_CLIENTS: dict[str, openai.OpenAI] = {}


def client(server: ServerProcess) -> openai.OpenAI:
    """One client per server (closed at the module's end: no socket left to the GC)."""
    if server.v1 not in _CLIENTS:
        _CLIENTS[server.v1] = openai.OpenAI(
            base_url=server.v1,
            api_key="key-alpha",
            max_retries=0,
            http_client=plain_http.client(),
        )
    return _CLIENTS[server.v1]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for each in _CLIENTS.values():
        each.close()
    _CLIENTS.clear()


REQUEST: dict[str, Any] = {
    "input": "Write a long story about a lighthouse.",
    "max_output_tokens": 300,
    "stream": True,
    "background": True,
    "extra_body": {"seed": 5},
}


def summary(events: list[Any]) -> list[tuple[int, str, str]]:
    """What must match between two runs of one seeded request (ids differ)."""
    return [
        (e.sequence_number, e.type, getattr(e, "delta", "") or getattr(e, "text", "") or "")
        for e in events
    ]


def read_until(server: ServerProcess, count: int) -> tuple[str, list[Any]]:
    """Start the request and drop the connection after ``count`` events."""
    events = []
    with client(server).responses.create(**REQUEST) as stream:
        for event in stream:
            events.append(event)
            if len(events) == count:
                break
    return events[0].response.id, events


def whole_stream(server: ServerProcess) -> Future[list[Any]]:
    """Every event of an unbroken run of :data:`REQUEST` (the same seed: the same events
    but for ids), read in the background."""
    return in_background(lambda: list(client(server).responses.create(**REQUEST)))


def test_a_background_stream_resumes_after_n_on_the_same_replica(
    replica: ServerProcess,
) -> None:
    unbroken = whole_stream(replica)
    response_id, first = read_until(replica, 20)
    rest = list(client(replica).responses.retrieve(response_id, stream=True, starting_after=19))
    whole = unbroken.result(60)
    assert whole[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in rest] == list(range(20, len(whole)))
    assert summary(first + rest) == summary(whole)
    # Nobody read it for a while and it was not stopped: a background response runs on.
    polled = client(replica).responses.retrieve(response_id)
    assert polled.status == whole[-1].response.status
    assert polled.output_text == whole[-1].response.output_text


def test_a_killed_replica_s_background_response_continues_on_another(
    replicas: Replicas,
) -> None:
    replica, doomed = replicas.replica, replicas.doomed
    unbroken = whole_stream(replica)
    response_id, first = read_until(doomed, 15)
    kill(doomed)
    whole = unbroken.result(60)
    # The other replica follows the log until the dead one's lease expires, then takes
    # the response over and continues it where the log ends: the client sees one stream.
    rest = list(client(replica).responses.retrieve(response_id, stream=True, starting_after=14))
    assert summary(first + rest) == summary(whole)
    assert client(replica).responses.retrieve(response_id).output_text == (
        whole[-1].response.output_text
    )


def test_a_polled_background_response_is_taken_over_after_a_crash(replicas: Replicas) -> None:
    replica, doomed = replicas.replica, replicas.doomed_polled
    body = {k: v for k, v in REQUEST.items() if k != "stream"}
    body["extra_body"] = {"seed": 6, "max_tokens_per_second": 200}
    started = client(doomed).responses.create(**body)
    kill(doomed)
    # Polling the other replica finds it unfinished and unleased (after the lease TTL):
    # it goes on there, and ends.
    polled = client(replica).responses.retrieve(started.id)
    deadline = time.monotonic() + 60  # far above a lease TTL and 300 tokens at 200/s
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        polled = client(replica).responses.retrieve(started.id)
    assert polled.status in ("completed", "incomplete"), polled.status
    assert polled.usage is not None and polled.usage.output_tokens > 0


def test_a_response_is_cancelled_from_another_replica(replicas: Replicas) -> None:
    replica, a = replicas.replica, replicas.other
    body = {k: v for k, v in REQUEST.items() if k != "stream"}
    body["max_output_tokens"] = 1500
    body["extra_body"] = {"seed": 7, "max_tokens_per_second": 20}
    started = client(a).responses.create(**body)
    # Asked of the replica that does not generate it: the one that does stops it.
    cancelled = client(replica).responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client(a).responses.retrieve(started.id).status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < 1500


def test_the_resume_bench_measures_every_case(redis_url: str, tmp_path: Path) -> None:
    result = resume_latency(tmp_path, samples=1, kills=1, redis_url=f"{redis_url}/4")
    assert {case: len(values) for case, values in result.samples.items()} == {
        "same replica": 1,
        "other replica": 1,
        "after a kill: first replayed event": 1,
        "after a kill: first new event": 1,
    }
    replayed, new = (
        result.samples[f"after a kill: first {k} event"][0] for k in ("replayed", "new")
    )
    assert 0 < replayed <= new
    assert (tmp_path / "resume.md").read_text().count("\n") == 6


def test_a_background_response_survives_a_restart_of_its_only_replica(
    replica: ServerProcess, tmp_path: Path
) -> None:
    """The in-memory store dies with the process; the job journal does not: the restarted
    replica generates the response again under the same id, to the same text."""
    journal = [
        "--journal-path",
        str(tmp_path / "jobs.sqlite3"),
        "--config",
        str(_tenants(tmp_path)),
    ]
    slow = [*SIM, "--sim-step-base-ms", "20", *journal]
    body = {k: v for k, v in REQUEST.items() if k != "stream"}
    body["max_output_tokens"] = 200
    # The same seeded request in the foreground, meanwhile (the sim answers a seed the
    # same on every replica): the text the restarted one must generate.
    again = in_background(lambda: client(replica).responses.create(**{**body, "background": False}))
    with servers((slow, "responses-restart-1")) as (first,):
        started = client(first).responses.create(**body)
        assert started.status == "queued"
        kill(first)  # at once: queued or mid-answer (200 tokens at 20 ms a step take 4 s)
    with servers(([*SIM, *journal], "responses-restart-2")) as (second,):
        polled = client(second).responses.retrieve(started.id)
        deadline = time.monotonic() + 60
        while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.05)
            polled = client(second).responses.retrieve(started.id)
        assert polled.status in ("completed", "incomplete"), polled.status
        assert polled.output_text == again.result(60).output_text


def _tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants: [{name: alpha, api_key: key-alpha}]\n")
    return path
