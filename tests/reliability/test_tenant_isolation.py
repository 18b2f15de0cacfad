"""Tenant isolation on every route that takes an id: another tenant gets the same 404 as
for an id that never existed (never the content, never an effect), and no key gets 401.

In process: streams are read as they are written
(:func:`tests.support.inprocess.streaming_client`), and the engine is held at a gate
while the stranger tries the owner's ids, so the owner's stream is still running then,
however slow the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.reliability.conftest import MODEL, assert_openai_error
from tests.simtext import expected_completion
from tests.support.inprocess import InProcessApp, gate_engine, serve_in_process, streaming_client

OWNER = {"authorization": "Bearer sk-owner"}
STRANGER = {"authorization": "Bearer sk-stranger"}
TENANTS = [
    {"name": "owner", "api_key": "sk-owner"},
    {"name": "stranger", "api_key": "sk-stranger"},
]
#: Only a broken server takes this long to end a stream once the gate is open.
DEADLINE_SECONDS = 30.0


@pytest.fixture
async def two_tenants(tmp_path: Path) -> AsyncIterator[InProcessApp]:
    async with serve_in_process(
        tenants=TENANTS, journal_path=str(tmp_path / "jobs.sqlite3"), flush_interval_ms=0
    ) as app:
        yield app


def routes_with_ids(stream_id: str, request_id: str, job_id: str) -> list[tuple[str, str]]:
    return [
        ("POST", f"/v1/requests/{request_id}/cancel"),
        ("GET", f"/v1/streams/{stream_id}?after=0"),
        ("GET", f"/v1/streams/{stream_id}"),
        ("GET", f"/v1/jobs/{job_id}"),
    ]


class OwnerStream:
    """The owner's streamed completion, read in the background as it is written."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        self.headers: dict[str, str] = {}
        self.lines: list[str] = []
        self.task = asyncio.create_task(self._read(client, body))

    async def _read(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        async with client.stream("POST", "/v1/completions", json=body, headers=OWNER) as response:
            assert response.status_code == 200
            self.headers.update(response.headers)
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    self.lines.append(line)

    @property
    def started(self) -> bool:
        return bool(self.headers) and bool(self.lines)

    @property
    def text(self) -> str:
        chunks = [orjson.loads(line[6:]) for line in self.lines if line.startswith("data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))

    async def end(self) -> None:
        await asyncio.wait_for(self.task, DEADLINE_SECONDS)


def stream_body(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 200,
        "seed": 4,
        "ignore_eos": True,
        "stream": True,
    }


async def test_another_tenant_cannot_see_or_touch_an_id(two_tenants: InProcessApp) -> None:
    http = two_tenants.client
    job = await http.post(
        "/v1/completions",
        headers=OWNER,
        json={"model": MODEL, "prompt": "secret job", "max_tokens": 8, "background": True},
    )
    assert job.status_code == 202, job.text
    job_id = job.json()["id"]

    async with streaming_client(two_tenants) as client:
        with gate_engine(two_tenants) as gate:
            owner = OwnerStream(client, stream_body("secret stream"))
            await gate.step_until(lambda: owner.started, "the owner's first event")
            stream_id = owner.headers["x-sluicegate-stream-id"]
            request_id = owner.headers["x-request-id"]

            unknown = routes_with_ids("cmpl-" + "0" * 32, "cmpl-" + "0" * 32, "job-" + "0" * 32)
            for (method, path), (_, unknown_path) in zip(
                routes_with_ids(stream_id, request_id, job_id), unknown, strict=True
            ):
                stranger = await http.request(method, path, headers=STRANGER)
                error = assert_openai_error(stranger, 404)
                assert "secret" not in stranger.text
                never_was = await http.request(method, unknown_path, headers=STRANGER)
                assert assert_openai_error(never_was, 404)["code"] == error["code"]
                assert_openai_error(await http.request(method, path), 401)
        await owner.end()
    # The stranger's cancel did nothing: the whole answer came, then the end.
    assert owner.lines[-1] == "data: [DONE]", owner.lines[-3:]
    assert owner.text == expected_completion("secret stream", 4, 200)
    mine = await http.get(f"/v1/jobs/{job_id}", headers=OWNER)
    assert mine.status_code == 200 and mine.json()["id"] == job_id


async def test_the_owner_can_cancel_its_own_request(two_tenants: InProcessApp) -> None:
    async with streaming_client(two_tenants) as client:
        with gate_engine(two_tenants) as gate:
            owner = OwnerStream(client, stream_body("mine"))
            await gate.step_until(lambda: owner.started, "the owner's first event")
            cancel = await two_tenants.client.post(
                f"/v1/requests/{owner.headers['x-request-id']}/cancel", headers=OWNER
            )
            assert cancel.status_code == 200, cancel.text
        await owner.end()
    # Cancelled while held at the gate a few tokens in: it ended long before its 200th.
    assert owner.lines[-1] == "data: [DONE]"
    assert len(owner.text.encode()) < 200
