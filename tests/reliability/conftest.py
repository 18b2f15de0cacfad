"""The reliability suite: the server (sim engine) under hostile, broken or heavy use.

Every case ends the same way: the client got a 4xx in OpenAI's error shape (or a 2xx),
never a 5xx, never a hung connection, and the server is still healthy after (it answers
``/health`` and a completion, and its log has no traceback).  What only sockets show
(malformed HTTP, floods, disconnects, a store going away) runs against real servers;
request bodies and routes are tested in process (:mod:`tests.support.inprocess`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.inprocess import InProcessApp
from tests.support.servers import ServerProcess, start_server

MODEL = "sluicegate-sim"
#: A fast sim engine with a short context, so that any request ends quickly.
FAST_SIM = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "0.5",
    "--sim-step-per-token-ms",
    "0.005",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "256",
    "--max-model-len",
    "256",
]


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx (or exactly ``status``, a 503 say) whose body is ``{"error": {"message",
    "type", "param", "code"}}`` with a non-empty message; returns the error object."""
    if status is None:
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    else:
        assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers.get("content-type", "").startswith("application/json"), response.text
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return dict(error)


#: How long a healthy server may take to answer ``/health`` on a loaded machine.  It
#: answers in milliseconds; one whose event loop is blocked or whose file descriptors
#: ran out never does: any finite bound tells the two apart, so this one is generous.
HEALTH_TIMEOUT_SECONDS = 10.0
SMALL_COMPLETION = {"model": MODEL, "prompt": "still there?", "max_tokens": 4}


def assert_healthy(server: ServerProcess) -> None:
    """``/health`` answers, a small completion works, and the log has no traceback
    (nothing crashed, nothing answered 500)."""
    health = httpx.get(server.base_url + "/health", timeout=HEALTH_TIMEOUT_SECONDS)
    assert health.status_code == 200
    completion = httpx.post(server.v1 + "/completions", json=SMALL_COMPLETION, timeout=30)
    assert completion.status_code == 200, completion.text
    assert_clean_log(server)


async def assert_healthy_in_process(app: InProcessApp) -> None:
    """The in-process twin of :func:`assert_healthy`: an exception in the app would have
    reached the client (``ASGITransport`` raises it), so no log needs reading."""
    assert (await app.client.get("/health")).status_code == 200
    completion = await app.client.post("/v1/completions", json=SMALL_COMPLETION)
    assert completion.status_code == 200, completion.text


def assert_clean_log(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log, log[log.find("Traceback") - 500 :][:3000]
    assert "Exception in ASGI application" not in log


@pytest.fixture(scope="package")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One open-mode (no API keys) server for the fuzzing, hostile-input and storm tests."""
    journal = tmp_path_factory.mktemp("open") / "jobs.sqlite3"
    server = start_server([*FAST_SIM, "--journal-path", str(journal)], "reliability-open")
    yield server
    server.stop()


def journal_args(tmp_path: Path) -> list[str]:
    return ["--journal-path", str(tmp_path / "jobs.sqlite3")]
