"""Who may see and act on what, through real servers: resume tokens in open mode, tenants'
keys, the admin key of the operator endpoints."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.resume.conftest import (
    SIM,
    Event,
    SSEReader,
    completion_body,
    config_file,
    owner,
    read_stream,
    resume,
)
from tests.simtext import expected_completion
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

TOKEN_HEADER = "x-sluicegate-resume-token"
TENANTS = [{"name": "alpha", "api_key": "key-alpha"}, {"name": "beta", "api_key": "key-beta"}]


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerProcess]:
    srv = start_server(
        [
            *SIM,
            "--flush-interval-ms",
            "0",
            "--detached-grace-seconds",
            "5",
            "--drain-grace-seconds",
            "0.5",
        ],
        "access-open",
    )
    yield srv
    srv.stop()


def test_open_mode_lists_no_ids_and_resuming_or_cancelling_needs_the_token(
    open_server: ServerProcess,
) -> None:
    srv = open_server
    first = read_stream(
        "POST", srv.v1 + "/completions", json=completion_body("secret", 5, 400), stop_after_events=3
    )
    sid = first.headers["x-sluicegate-stream-id"]

    # The detached stream is visible to operators, but not its id.
    stats = httpx.get(srv.v1 + "/stats", timeout=5)
    assert stats.status_code == 200 and sid not in stats.text
    assert stats.json()["streams_scope"] == "anonymous"
    assert stats.json()["streams"] and "request_id" not in stats.json()["streams"][0]

    # The id alone, or with a wrong token: the 404 of an id that never existed.
    streams = f"{srv.v1}/streams/{sid}"
    cancel = f"{srv.v1}/requests/{sid}/cancel"
    token = first.headers[TOKEN_HEADER]
    assert len(token) >= 40 and token not in sid
    for response in (
        httpx.get(streams, timeout=5),
        httpx.get(streams, headers={TOKEN_HEADER: token[:-1] + "x"}, timeout=5),
        httpx.get(f"{srv.v1}/streams/cmpl-{'0' * 32}", headers=owner(first), timeout=5),
        httpx.post(cancel, timeout=5),
    ):
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "not_found" and TOKEN_HEADER in error["message"]

    # The token, in the header or (for an EventSource) the query: the rest of the stream.
    rest = read_stream(
        "GET",
        f"{streams}?resume_token={token}",
        headers={"last-event-id": str(first.last_event_id)},
    )
    assert rest.status == 200 and rest.done
    assert first.text + rest.text == expected_completion("secret", 5, 400)
    assert resume(srv, sid, None, headers=owner(first)).text == first.text + rest.text


def test_an_owner_whose_stream_is_resumed_elsewhere_is_told(open_server: ServerProcess) -> None:
    """A second connection takes the stream over; the first one ends with an error event,
    never silently."""
    srv = open_server
    headers: dict[str, str] = {}
    owner_events: list[Event] = []
    three_events = threading.Event()

    def owner_reads() -> None:
        reader = SSEReader()
        body = completion_body("two readers", 3, 600)
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", srv.v1 + "/completions", json=body) as resp,
        ):
            headers.update(resp.headers)
            for line in resp.iter_lines():
                event = reader.feed(line)
                if event is not None:
                    owner_events.append(event)
                    if len(owner_events) == 3:
                        three_events.set()

    thread = threading.Thread(target=owner_reads)
    thread.start()
    assert three_events.wait(10)
    sid = headers["x-sluicegate-stream-id"]
    taken = resume(srv, sid, f"{sid}:1", headers={TOKEN_HEADER: headers.get(TOKEN_HEADER, "")})
    thread.join(30)
    assert taken.status == 200 and taken.done
    assert owner_events[-1].data == "[DONE]"
    notice = owner_events[-2].error
    assert notice is not None and notice["code"] == "stream_superseded", owner_events[-3:]
    assert notice["stream_id"] == sid and f"/v1/streams/{sid}" in notice["message"]
    expected = expected_completion("two readers", 3, 600)
    assert "".join(e.text for e in owner_events[:1]) + taken.text == expected


def stream_and_drop(srv: ServerProcess, key: str, prompt: str) -> str:
    got = read_stream(
        "POST",
        srv.v1 + "/completions",
        json=completion_body(prompt, 1, 400),
        headers=auth(key),
        stop_after_events=3,
    )
    return got.headers["x-sluicegate-stream-id"]


def test_with_tenants_a_key_sees_only_its_own_streams_and_models_needs_one(
    tmp_path: Path,
) -> None:
    config = config_file(tmp_path, "tenants", {"tenants": TENANTS})
    srv = start_server(
        [
            *SIM,
            "--config",
            config,
            "--flush-interval-ms",
            "0",
            "--detached-grace-seconds",
            "5",
            "--drain-grace-seconds",
            "0.5",
        ],
        "access-tenants",
    )
    try:
        models = srv.v1 + "/models"
        assert httpx.get(models, timeout=5).status_code == 401
        wrong = httpx.get(models, headers=auth("key-gamma"), timeout=5)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(models, headers=auth("key-alpha"), timeout=5).json()["data"]

        alpha = stream_and_drop(srv, "key-alpha", "alpha's")
        beta = stream_and_drop(srv, "key-beta", "beta's")

        anonymous = httpx.get(srv.v1 + "/stats", timeout=5)
        assert anonymous.status_code == 200 and anonymous.json()["requests_running"] == 2
        assert anonymous.json()["streams"] == [] and anonymous.json()["streams_scope"] == "none"
        assert alpha not in anonymous.text and beta not in anonymous.text

        def seen_by(key: str) -> list[dict[str, Any]]:
            response = httpx.get(srv.v1 + "/stats", headers=auth(key), timeout=5)
            assert response.status_code == 200 and response.json()["streams_scope"] == "tenant"
            streams: list[dict[str, Any]] = response.json()["streams"]
            return streams

        assert [s["request_id"] for s in seen_by("key-alpha")] == [alpha]
        assert [s["request_id"] for s in seen_by("key-beta")] == [beta]
        assert httpx.get(srv.v1 + "/stats", headers=auth("nope"), timeout=5).status_code == 401

        cancel = f"{srv.v1}/requests/{beta}/cancel"
        assert httpx.post(cancel, headers=auth("key-alpha"), timeout=5).status_code == 404
        assert httpx.post(cancel, headers=auth("key-beta"), timeout=5).status_code == 200
    finally:
        srv.stop()


def test_the_admin_key_guards_stats_and_metrics(tmp_path: Path) -> None:
    config = config_file(tmp_path, "admin", {"tenants": TENANTS})
    srv = start_server(
        [*SIM, "--config", config, "--detached-grace-seconds", "5", "--drain-grace-seconds", "0.5"],
        "access-admin",
        env={"SLUICEGATE_ADMIN_API_KEY": "key-admin"},
    )
    try:
        for path in ("/metrics", "/v1/stats"):
            for headers in ({}, auth("key-alpha"), auth("key-admin-")):
                refused = httpx.get(srv.base_url + path, headers=headers, timeout=5)
                assert refused.status_code == 401, (path, headers)
                error = refused.json()["error"]
                assert error["code"] == "invalid_api_key" and "admin" in error["message"]
        metrics = httpx.get(srv.base_url + "/metrics", headers=auth("key-admin"), timeout=5)
        assert metrics.status_code == 200 and "sluicegate_requests_total" in metrics.text

        alpha = stream_and_drop(srv, "key-alpha", "watched")
        stats = httpx.get(srv.v1 + "/stats", headers=auth("key-admin"), timeout=5).json()
        assert stats["streams_scope"] == "all"
        assert [(s["request_id"], s["tenant"]) for s in stats["streams"]] == [(alpha, "alpha")]

        # The admin key reads the model list but is no tenant: it completes nothing.
        models = httpx.get(srv.v1 + "/models", headers=auth("key-admin"), timeout=5)
        assert models.status_code == 200
        completion = httpx.post(
            srv.v1 + "/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers=auth("key-admin"),
            timeout=5,
        )
        assert completion.status_code == 401
        for public in ("/health", "/ready"):
            assert httpx.get(srv.base_url + public, timeout=5).status_code == 200
    finally:
        srv.stop()
