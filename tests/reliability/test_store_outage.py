"""Redis stopped in the middle of a stream, in both failure modes.

fail_open: the stream finishes, new requests are served (without replay logs and shared
limits), ``/ready`` stays 200.  fail_closed: the stream ends with an error event (it does
not hang), every new request (streamed or not) gets 503 ``store_unavailable`` and
``/ready`` is 503 until Redis is back; then all is served again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import (
    HEALTH_TIMEOUT_SECONDS,
    MODEL,
    assert_clean_log,
    assert_openai_error,
)
from tests.store.conftest import RedisServer, start_redis
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

SIM = ["--engine", "sim", "--sim-step-base-ms", "5", "--sim-step-per-token-ms", "0"]
#: The long stream: paced at 100 tokens/s, its 150 tokens take at least 1.5 s however
#: fast the machine, so it is still running when Redis is killed a moment after its first
#: events (killing takes milliseconds).
LONG_STREAM_TOKENS = 150
LONG_STREAM_TOKENS_PER_SECOND = 100
#: Only a broken server takes this long (to end a stream, or to change its readiness).
DEADLINE_SECONDS = 30.0


@pytest.fixture
def redis_for_outage(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path)
    yield server
    server.kill()


class StreamReader(threading.Thread):
    """Reads one long stream in the background, noting how it ended."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.lines: list[str] = []
        self.status = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": "a long story",
            "max_tokens": LONG_STREAM_TOKENS,
            "max_tokens_per_second": LONG_STREAM_TOKENS_PER_SECOND,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", self.server.v1 + "/completions", json=body, timeout=DEADLINE_SECONDS
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line)
        except httpx.HTTPError as error:
            self.failure = error

    @property
    def done(self) -> bool:
        return bool(self.lines) and self.lines[-1] == "data: [DONE]"

    @property
    def ended_with_error(self) -> bool:
        return any('"error"' in line for line in self.lines[-2:])


def start_stream(server: ServerProcess) -> StreamReader:
    reader = StreamReader(server)
    reader.start()
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(reader.lines) < 5:
        assert time.monotonic() < deadline and reader.is_alive(), reader.lines
        time.sleep(0.02)
    return reader


def wait_for_ready(server: ServerProcess, status: int, seconds: float = DEADLINE_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while True:
        got = httpx.get(server.base_url + "/ready", timeout=HEALTH_TIMEOUT_SECONDS).status_code
        if got == status:
            return
        assert time.monotonic() < deadline, f"/ready is {got}, not {status}"
        time.sleep(0.1)


def small(server: ServerProcess, *, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    return httpx.post(server.v1 + "/completions", json=body, timeout=DEADLINE_SECONDS)


def test_fail_open_keeps_serving_through_an_outage(
    redis_for_outage: RedisServer, tmp_path: Path
) -> None:
    args = [
        *SIM,
        "--store",
        redis_for_outage.url,
        "--store-failure-mode",
        "fail_open",
        "--journal-path",
        str(tmp_path / "jobs.sqlite3"),
    ]
    server = start_server(args, "outage-open")
    try:
        reader = start_stream(server)
        redis_for_outage.kill()
        reader.join(DEADLINE_SECONDS)
        assert not reader.is_alive() and reader.failure is None
        assert reader.done, reader.lines[-3:]
        assert small(server).status_code == 200
        assert small(server, stream=True).status_code == 200
        ready = httpx.get(server.base_url + "/ready", timeout=HEALTH_TIMEOUT_SECONDS)
        assert ready.status_code == 200
        assert server.metrics().total("sluicegate_store_available") == 0
        assert (
            httpx.get(server.base_url + "/health", timeout=HEALTH_TIMEOUT_SECONDS).status_code
            == 200
        )
        assert_clean_log(server)
    finally:
        server.stop()


def test_fail_closed_refuses_everything_until_the_store_is_back(
    redis_for_outage: RedisServer, tmp_path: Path
) -> None:
    args = [
        *SIM,
        "--store",
        redis_for_outage.url,
        "--store-failure-mode",
        "fail_closed",
        "--journal-path",
        str(tmp_path / "jobs.sqlite3"),
    ]
    server = start_server(args, "outage-closed")
    try:
        reader = start_stream(server)
        redis_for_outage.kill()
        reader.join(DEADLINE_SECONDS)
        assert not reader.is_alive(), "the stream hung after the store went away"
        assert reader.ended_with_error or reader.failure is not None, reader.lines[-3:]
        wait_for_ready(server, 503)
        for stream in (False, True):
            error = assert_openai_error(small(server, stream=stream), 503)
            assert error["code"] == "store_unavailable", error
        assert (
            httpx.get(server.base_url + "/health", timeout=HEALTH_TIMEOUT_SECONDS).status_code
            == 200
        )

        redis_for_outage.start()
        wait_for_ready(server, 200)
        assert small(server).status_code == 200
        assert small(server, stream=True).status_code == 200
        assert_clean_log(server)
    finally:
        server.stop()
