"""Resumable streams through real servers: SSE reading, dropping and resuming, and Redis.

Helpers parse SSE the way the spec says (fields per line, events at blank lines, the last
event id carried over), so tests see exactly what a careful client sees.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.store.conftest import RedisServer, start_redis
from tests.support import plain_http
from tests.support.servers import ServerProcess, start_servers

MODEL = "sluicegate-sim"
#: A sim engine that takes a while per token, so a stream is still running when cut.
SIM = ["--engine", "sim", "--sim-step-base-ms", "4", "--sim-step-per-token-ms", "0"]


@dataclass
class Event:
    """One dispatched SSE event."""

    data: str
    event_id: str | None

    @property
    def seq(self) -> int | None:
        return None if self.event_id is None else int(self.event_id.rsplit(":", 1)[1])

    @property
    def json(self) -> dict[str, Any] | None:
        if not self.data.startswith("{"):
            return None
        payload: dict[str, Any] = orjson.loads(self.data)
        return payload

    @property
    def text(self) -> str:
        """The text delta of a chat or completion chunk ("" for anything else)."""
        payload = self.json
        if payload is None or not payload.get("choices"):
            return ""
        choice = payload["choices"][0]
        if "delta" in choice:
            return str(choice["delta"].get("content") or "")
        return str(choice.get("text") or "")

    @property
    def error(self) -> dict[str, Any] | None:
        payload = self.json
        return None if payload is None else payload.get("error")


@dataclass
class SSEReader:
    """A spec-following SSE parser over lines."""

    last_event_id: str | None = None
    _data: list[str] = field(default_factory=list)
    _id_seen: bool = False

    def feed(self, line: str) -> Event | None:
        if not line:
            if not self._data:
                return None
            event = Event("\n".join(self._data), self.last_event_id if self._id_seen else None)
            self._data = []
            self._id_seen = False
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "id":
            self.last_event_id = value
            self._id_seen = True
        return None


@dataclass
class Received:
    """What one connection received."""

    events: list[Event]
    headers: dict[str, str]
    status: int

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def last_event_id(self) -> str | None:
        ids = [e.event_id for e in self.events if e.event_id is not None]
        return ids[-1] if ids else None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].data == "[DONE]"

    @property
    def seqs(self) -> list[int]:
        return [e.seq for e in self.events if e.seq is not None]


def read_stream(
    method: str,
    url: str,
    *,
    json: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    stop_after_events: int | None = None,
    timeout: float = 30.0,
    on_response: Callable[[], None] | None = None,
) -> Received:
    """Read an SSE response; with ``stop_after_events``, drop the connection after that
    many events that carry an id (a client whose connection broke).  ``on_response`` is
    called when the response's headers have arrived."""
    reader = SSEReader()
    events: list[Event] = []
    with (
        plain_http.client(timeout=timeout) as client,
        client.stream(method, url, json=json, headers=headers) as resp,
    ):
        if on_response is not None:
            on_response()
        if resp.status_code != 200:
            resp.read()
            return Received([Event(resp.text, None)], dict(resp.headers), resp.status_code)
        for line in resp.iter_lines():
            event = reader.feed(line)
            if event is None:
                continue
            events.append(event)
            if (
                stop_after_events is not None
                and sum(1 for e in events if e.event_id) >= stop_after_events
            ):
                break
        return Received(events, dict(resp.headers), resp.status_code)


def received(response: httpx.Response) -> Received:
    """What a response read whole received (in process, a stream is read after its end)."""
    if response.status_code != 200:
        return Received([Event(response.text, None)], dict(response.headers), response.status_code)
    reader = SSEReader()
    events = [event for line in response.text.splitlines() if (event := reader.feed(line))]
    return Received(events, dict(response.headers), response.status_code)


def owner(received: Received) -> dict[str, str]:
    """The header that proves a caller owns a stream in open mode: the resume token its
    creating response carried."""
    return {"x-sluicegate-resume-token": received.headers["x-sluicegate-resume-token"]}


def resume(
    server: ServerProcess,
    stream_id: str,
    last_event_id: str | None,
    *,
    headers: dict[str, str] | None = None,
) -> Received:
    extra = {} if last_event_id is None else {"last-event-id": last_event_id}
    return read_stream(
        "GET", f"{server.v1}/streams/{stream_id}", headers={**(headers or {}), **extra}
    )


def completion_body(prompt: str, seed: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def chat_body(content: str, seed: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


def assert_continues(first: Received, rest: Received) -> None:
    """No event lost or repeated: the resumed seqs follow the last one received."""
    seqs = first.seqs + rest.seqs
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert rest.done


def config_file(tmp_path: Path, name: str, settings: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


@contextlib.contextmanager
def servers(*specs: tuple[list[str], str]) -> Iterator[list[ServerProcess]]:
    """Servers started together (:func:`start_servers`), stopped at the block's end."""
    started = start_servers(*specs)
    try:
        yield started
    finally:
        for server in started:
            if server.process.poll() is None:
                server.stop()


def kill(server: ServerProcess) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real Redis for the resume tests (each server uses its own database number
    where it matters)."""
    server: RedisServer = start_redis(tmp_path_factory.mktemp("resume-redis"))
    yield f"redis://127.0.0.1:{server.port}"
    server.kill()
