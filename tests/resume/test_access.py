"""Who may resume what, expiry, and a store that goes away at run time: in process
(:mod:`tests.support.inprocess`), but for the resume token on another replica, which
takes two server processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.resume.conftest import (
    SIM,
    completion_body,
    config_file,
    owner,
    read_stream,
    received,
    resume,
)
from tests.simtext import expected_completion
from tests.store.conftest import start_redis
from tests.support import plain_http
from tests.support.inprocess import serve_in_process
from tests.support.servers import start_servers

pytestmark = pytest.mark.slow

TENANTS = [
    {"name": "alpha", "api_key": "key-alpha"},
    {"name": "beta", "api_key": "key-beta"},
]


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_only_the_creating_tenant_can_resume_and_expired_streams_are_410(
    tmp_path: Path,
) -> None:
    config = config_file(tmp_path, "tenants", {"tenants": TENANTS})
    # Three seconds to live: the checks below must run before the log expires (in
    # process, they take milliseconds).
    async with serve_in_process("--config", config, "--replay-ttl-seconds", "3") as app:
        http = app.client
        body = completion_body("mine", 9, 30)
        first = received(await http.post("/v1/completions", json=body, headers=auth("key-alpha")))
        stream_id = first.headers["x-sluicegate-stream-id"]
        streams = f"/v1/streams/{stream_id}"

        other = await http.get(streams, headers=auth("key-beta"))
        unknown = await http.get("/v1/streams/cmpl-nope", headers=auth("key-beta"))
        assert other.status_code == unknown.status_code == 404
        # Indistinguishable from an id that never existed.
        assert other.json()["error"]["code"] == unknown.json()["error"]["code"] == "not_found"
        assert (await http.get(streams)).status_code == 401
        mine = received(await http.get(streams, headers=auth("key-alpha")))
        assert mine.status == 200 and mine.text == expected_completion("mine", 9, 30)

        # Then the log is gone once its time to live has passed.
        deadline = time.monotonic() + 60
        while (expired := await http.get(streams, headers=auth("key-alpha"))).status_code == 200:
            assert time.monotonic() < deadline, "the log outlived its time to live"
            await asyncio.sleep(0.1)
        assert expired.status_code == 410
        error = expired.json()["error"]
        assert error["code"] == "stream_expired" and "expired" in error["message"]


async def test_redis_lost_at_run_time_fail_open_serves_without_ids(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    try:
        async with serve_in_process("--store", redis.url) as app:
            http = app.client
            body = completion_body("up", 1, 20)
            ok = received(await http.post("/v1/completions", json=body))
            assert ok.seqs
            redis.kill()
            body = completion_body("down", 2, 20)
            down = received(await http.post("/v1/completions", json=body))
            assert down.status == 200 and down.done
            assert down.text == expected_completion("down", 2, 20)
            assert not down.seqs  # not logged: nothing to resume past
            metrics = (await http.get("/metrics")).text
            assert "sluicegate_store_available 0.0" in metrics
            assert (
                'sluicegate_store_degraded_operations_total{operation="append",outcome="dropped"}'
                in metrics
            )
            assert (await http.get("/health")).status_code == 200
    finally:
        redis.kill()


async def test_redis_lost_at_run_time_fail_closed_refuses(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    tenants = [{"name": "limited", "api_key": "key-limited", "requests_per_second": 100}]
    config = config_file(tmp_path, "closed", {"tenants": tenants})
    args = ["--store", redis.url, "--config", config, "--store-failure-mode", "fail_closed"]
    try:
        async with serve_in_process(*args) as app:
            redis.kill()
            refused = await app.client.post(
                "/v1/completions", json=completion_body("down", 2, 20), headers=auth("key-limited")
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "store_unavailable"
            assert "retry-after" in refused.headers
            assert 'outcome="raised"' in (await app.client.get("/metrics")).text
            assert (await app.client.get("/health")).status_code == 200
    finally:
        redis.kill()


def test_in_open_mode_the_resume_token_works_on_every_replica(redis_url: str) -> None:
    """The token's digest travels in the stream's metadata in Redis: another replica
    checks it too, before it relays or takes the stream over."""
    args = [
        *SIM,
        "--store",
        f"{redis_url}/3",
        "--flush-interval-ms",
        "0",
        "--lease-ttl-seconds",
        "1",
        "--detached-grace-seconds",
        "0.5",
    ]
    a, b = start_servers((args, "open-token-a"), (args, "open-token-b"))
    try:
        body = completion_body("any replica", 13, 300)
        first = read_stream("POST", a.v1 + "/completions", json=body, stop_after_events=10)
        sid = first.headers["x-sluicegate-stream-id"]
        stranger = plain_http.get(f"{b.v1}/streams/{sid}", timeout=5)
        assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "not_found"
        rest = resume(b, sid, first.last_event_id, headers=owner(first))
        assert first.text + rest.text == expected_completion("any replica", 13, 300)
        assert rest.done
    finally:
        a.stop()
        b.stop()
