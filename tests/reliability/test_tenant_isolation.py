"""Tenant isolation on every route that takes an id: another tenant gets the same 404 as
for an id that never existed (never the content, never an effect), and no key gets 401."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.reliability.conftest import MODEL, assert_clean_log, assert_openai_error
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

OWNER = {"authorization": "Bearer sk-owner"}
STRANGER = {"authorization": "Bearer sk-stranger"}


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory: Path = tmp_path_factory.mktemp("tenants")
    config = directory / "tenants.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                "sim_step_base_ms": 5,
                "sim_step_per_token_ms": 0,
                "journal_path": str(directory / "jobs.sqlite3"),
                "tenants": [
                    {"name": "owner", "api_key": "sk-owner"},
                    {"name": "stranger", "api_key": "sk-stranger"},
                ],
            }
        )
    )
    server = start_server(["--config", str(config)], "tenants")
    yield server
    server.stop()


def routes_with_ids(stream_id: str, request_id: str, job_id: str) -> list[tuple[str, str]]:
    return [
        ("POST", f"/v1/requests/{request_id}/cancel"),
        ("GET", f"/v1/streams/{stream_id}?after=0"),
        ("GET", f"/v1/streams/{stream_id}"),
        ("GET", f"/v1/jobs/{job_id}"),
    ]


def test_another_tenant_cannot_see_or_touch_an_id(two_tenants: ServerProcess) -> None:
    base = two_tenants.base_url
    job = httpx.post(
        two_tenants.v1 + "/completions",
        headers=OWNER,
        timeout=10,
        json={"model": MODEL, "prompt": "secret job", "max_tokens": 8, "background": True},
    )
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]

    lines: list[str] = []
    headers: dict[str, str] = {}

    def read_owner_stream() -> None:
        body = {
            "model": MODEL,
            "prompt": "secret stream",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", two_tenants.v1 + "/completions", json=body, headers=OWNER, timeout=30
        ) as response:
            headers.update(response.headers)
            lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

    owner = threading.Thread(target=read_owner_stream, daemon=True)
    owner.start()
    deadline = time.monotonic() + 10
    while not headers or not lines:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stream_id = headers["x-sluicegate-stream-id"]
    request_id = headers["x-request-id"]

    unknown = routes_with_ids("cmpl-" + "0" * 32, "cmpl-" + "0" * 32, "job-" + "0" * 32)
    for (method, path), (_, unknown_path) in zip(
        routes_with_ids(stream_id, request_id, job_id), unknown, strict=True
    ):
        stranger = httpx.request(method, base + path, headers=STRANGER, timeout=5)
        error = assert_openai_error(stranger, 404)
        assert "secret" not in stranger.text
        never_was = httpx.request(method, base + unknown_path, headers=STRANGER, timeout=5)
        assert assert_openai_error(never_was, 404)["code"] == error["code"]
        assert_openai_error(httpx.request(method, base + path, timeout=5), 401)

    owner.join(30)
    assert lines[-1] == "data: [DONE]", lines[-3:]  # the stranger's cancel did nothing
    mine = httpx.get(f"{two_tenants.v1}/jobs/{job_id}", headers=OWNER, timeout=5)
    assert mine.status_code == 200 and mine.json()["id"] == job_id
    assert_clean_log(two_tenants)


def test_the_owner_can_cancel_its_own_request(two_tenants: ServerProcess) -> None:
    done = threading.Event()
    headers: dict[str, str] = {}

    def read() -> None:
        body = {
            "model": MODEL,
            "prompt": "mine",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", two_tenants.v1 + "/completions", json=body, headers=OWNER, timeout=30
        ) as response:
            headers.update(response.headers)
            for _ in response.iter_lines():
                pass
        done.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 10
    while not headers:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancel = httpx.post(
        f"{two_tenants.v1}/requests/{headers['x-request-id']}/cancel", headers=OWNER, timeout=5
    )
    assert cancel.status_code == 200, cancel.text
    assert done.wait(10)
