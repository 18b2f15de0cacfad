"""Who may see and act on what, in process: resume tokens in open mode, tenants' keys,
the admin key of the operator endpoints.

Streams are read as they are written (:func:`tests.support.inprocess.streaming_client`),
and the engine is held at a gate (:func:`tests.support.inprocess.gate_engine`) while a
test looks at a stream that must still be running: it cannot finish meanwhile, however
slow the machine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.resume.conftest import Event, SSEReader, completion_body
from tests.simtext import expected_completion
from tests.support.inprocess import gate_engine, serve_in_process, streaming_client

TOKEN_HEADER = "x-sluicegate-resume-token"
TENANTS = [{"name": "alpha", "api_key": "key-alpha"}, {"name": "beta", "api_key": "key-beta"}]
#: A detached stream is kept long past any test's checks (it is held at the gate anyway).
SETTINGS: dict[str, Any] = {
    "flush_interval_ms": 0,
    "detached_grace_seconds": 60,
    "drain_grace_seconds": 0.5,
}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@dataclass
class Reading:
    """What one connection has received so far."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    @property
    def num_ids(self) -> int:
        return sum(1 for e in self.events if e.event_id)

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

    def owner(self) -> dict[str, str]:
        """The header that proves its reader owns the stream in open mode."""
        return {TOKEN_HEADER: self.headers[TOKEN_HEADER]}


async def read(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    into: Reading | None = None,
    *,
    json: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    leave_after: int | None = None,
) -> Reading:
    """Read an SSE response into ``into`` as it comes; with ``leave_after``, the client
    goes away after that many events with an id."""
    reading = into if into is not None else Reading()
    reader = SSEReader()
    async with client.stream(method, url, json=json, headers=headers) as response:
        reading.headers.update(response.headers)
        reading.status = response.status_code
        async for line in response.aiter_lines():
            event = reader.feed(line)
            if event is None:
                continue
            reading.events.append(event)
            if leave_after is not None and reading.num_ids >= leave_after:
                break
    return reading


async def test_open_mode_lists_no_ids_and_resuming_or_cancelling_needs_the_token() -> None:
    async with serve_in_process(**SETTINGS) as app, streaming_client(app) as client:
        body = completion_body("secret", 5, 400)
        with gate_engine(app) as gate:
            reading = asyncio.create_task(
                read(client, "POST", "/v1/completions", json=body, leave_after=3)
            )
            await gate.step_until(reading.done, "three events, then the client leaves")
            first = await reading
            sid = first.headers["x-sluicegate-stream-id"]

            # The detached stream is visible to operators, but not its id.
            stats = await app.client.get("/v1/stats")
            assert stats.status_code == 200 and sid not in stats.text
            assert stats.json()["streams_scope"] == "anonymous"
            assert stats.json()["streams"] and "request_id" not in stats.json()["streams"][0]

            # The id alone, or with a wrong token: the 404 of an id that never existed.
            streams = f"/v1/streams/{sid}"
            token = first.headers[TOKEN_HEADER]
            assert len(token) >= 40 and token not in sid
            for response in (
                await app.client.get(streams),
                await app.client.get(streams, headers={TOKEN_HEADER: token[:-1] + "x"}),
                await app.client.get(f"/v1/streams/cmpl-{'0' * 32}", headers=first.owner()),
                await app.client.post(f"/v1/requests/{sid}/cancel"),
            ):
                assert response.status_code == 404, response.text
                error = response.json()["error"]
                assert error["code"] == "not_found" and TOKEN_HEADER in error["message"]

        # The token, in the header or (for an EventSource) the query: the rest of the stream.
        rest = await read(
            app.client,
            "GET",
            f"{streams}?resume_token={token}",
            headers={"last-event-id": str(first.last_event_id)},
        )
        assert rest.status == 200 and rest.done
        assert first.text + rest.text == expected_completion("secret", 5, 400)
        replayed = await read(app.client, "GET", streams, headers=first.owner())
        assert replayed.text == first.text + rest.text


async def test_an_owner_whose_stream_is_resumed_elsewhere_is_told() -> None:
    """A second connection takes the stream over; the first one ends with an error event,
    never silently."""
    async with serve_in_process(**SETTINGS) as app, streaming_client(app) as client:
        body = completion_body("two readers", 3, 600)
        owner, taken = Reading(), Reading()
        with gate_engine(app) as gate:
            owner_reads = asyncio.create_task(
                read(client, "POST", "/v1/completions", owner, json=body)
            )
            await gate.step_until(lambda: owner.num_ids >= 3, "three events for the owner")
            sid = owner.headers["x-sluicegate-stream-id"]
            headers = {**owner.owner(), "last-event-id": f"{sid}:1"}
            taker_reads = asyncio.create_task(
                read(client, "GET", f"/v1/streams/{sid}", taken, headers=headers)
            )
            await gate.step_until(lambda: taken.status is not None, "the takeover")
        await asyncio.gather(owner_reads, taker_reads)
    assert taken.status == 200 and taken.done
    assert owner.events[-1].data == "[DONE]"
    notice = owner.events[-2].error
    assert notice is not None and notice["code"] == "stream_superseded", owner.events[-3:]
    assert notice["stream_id"] == sid and f"/v1/streams/{sid}" in notice["message"]
    expected = expected_completion("two readers", 3, 600)
    assert "".join(e.text for e in owner.events[:1]) + taken.text == expected


async def test_with_tenants_a_key_sees_only_its_own_streams_and_models_needs_one() -> None:
    async with (
        serve_in_process(tenants=TENANTS, **SETTINGS) as app,
        streaming_client(app) as client,
    ):
        http = app.client
        assert (await http.get("/v1/models")).status_code == 401
        wrong = await http.get("/v1/models", headers=auth("key-gamma"))
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/v1/models", headers=auth("key-alpha"))).json()["data"]

        with gate_engine(app) as gate:
            readings = [
                asyncio.create_task(
                    read(
                        client,
                        "POST",
                        "/v1/completions",
                        json=completion_body(f"{key}'s", 1, 400),
                        headers=auth(key),
                        leave_after=3,
                    )
                )
                for key in ("key-alpha", "key-beta")
            ]
            await gate.step_until(
                lambda: all(r.done() for r in readings), "three events of each, then they leave"
            )
            alpha, beta = [(await r).headers["x-sluicegate-stream-id"] for r in readings]

            anonymous = await http.get("/v1/stats")
            assert anonymous.status_code == 200 and anonymous.json()["requests_running"] == 2
            assert anonymous.json()["streams"] == []
            assert anonymous.json()["streams_scope"] == "none"
            assert alpha not in anonymous.text and beta not in anonymous.text

            async def seen_by(key: str) -> list[dict[str, Any]]:
                response = await http.get("/v1/stats", headers=auth(key))
                assert response.status_code == 200
                assert response.json()["streams_scope"] == "tenant"
                streams: list[dict[str, Any]] = response.json()["streams"]
                return streams

            assert [s["request_id"] for s in await seen_by("key-alpha")] == [alpha]
            assert [s["request_id"] for s in await seen_by("key-beta")] == [beta]
            assert (await http.get("/v1/stats", headers=auth("nope"))).status_code == 401

            cancel = f"/v1/requests/{beta}/cancel"
            assert (await http.post(cancel, headers=auth("key-alpha"))).status_code == 404
            assert (await http.post(cancel, headers=auth("key-beta"))).status_code == 200


async def test_the_admin_key_guards_stats_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_ADMIN_API_KEY", "key-admin")
    async with (
        serve_in_process(tenants=TENANTS, **SETTINGS) as app,
        streaming_client(app) as client,
    ):
        http = app.client
        for path in ("/metrics", "/v1/stats"):
            for headers in ({}, auth("key-alpha"), auth("key-admin-")):
                refused = await http.get(path, headers=headers)
                assert refused.status_code == 401, (path, headers)
                error = refused.json()["error"]
                assert error["code"] == "invalid_api_key" and "admin" in error["message"]
        metrics = await http.get("/metrics", headers=auth("key-admin"))
        assert metrics.status_code == 200 and "sluicegate_requests_total" in metrics.text

        with gate_engine(app) as gate:
            reading = asyncio.create_task(
                read(
                    client,
                    "POST",
                    "/v1/completions",
                    json=completion_body("watched", 1, 400),
                    headers=auth("key-alpha"),
                    leave_after=3,
                )
            )
            await gate.step_until(reading.done, "three events, then the client leaves")
            alpha = (await reading).headers["x-sluicegate-stream-id"]
            stats = (await http.get("/v1/stats", headers=auth("key-admin"))).json()
            assert stats["streams_scope"] == "all"
            assert [(s["request_id"], s["tenant"]) for s in stats["streams"]] == [(alpha, "alpha")]

        # The admin key reads the model list but is no tenant: it completes nothing.
        assert (await http.get("/v1/models", headers=auth("key-admin"))).status_code == 200
        completion = await http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth("key-admin")
        )
        assert completion.status_code == 401
        for public in ("/health", "/ready"):
            assert (await http.get(public)).status_code == 200
