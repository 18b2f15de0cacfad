"""The whole app in the test's own event loop: ``create_app`` with its lifespan run, talked
to through ``httpx.ASGITransport``.  No process and no port: milliseconds to start, and
the same routes, admission, queue, engine core (the sim's thread) and stream writers as a
served app.

What it cannot show is what only sockets show (flow control against a slow socket,
connection limits, signals, replicas): those tests start a real server
(:mod:`tests.support.servers`).  ``ASGITransport`` hands a response over when the app has
sent all of it, so a stream is read whole, after its end.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from openai import AsyncOpenAI

from sluicegate.api.app import create_app
from sluicegate.api.state import AppState
from sluicegate.bench.scrape import MetricsSnapshot, parse_metrics
from sluicegate.config import load_settings
from sluicegate.service.service import Service

BASE_URL = "http://sluicegate.test"

#: The sim engine at ~1 ms a step: fast, and slow enough for requests to overlap.
FAST_SIM: dict[str, Any] = {
    "engine": "sim",
    "sim_step_base_ms": 1.0,
    "sim_step_per_token_ms": 0.01,
}


@dataclass(slots=True)
class InProcessApp:
    """A running app and an HTTP client for it."""

    app: FastAPI
    state: AppState
    client: httpx.AsyncClient

    @property
    def service(self) -> Service:
        assert self.state.ready is not None
        return self.state.ready.service

    def openai(self, api_key: str = "none", **options: Any) -> AsyncOpenAI:
        """The official client, unmodified, over this app."""
        return AsyncOpenAI(
            base_url=BASE_URL + "/v1", api_key=api_key, http_client=self.client, **options
        )

    async def stats(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        response = await self.client.get("/v1/stats", headers=headers)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    async def metrics(self, headers: dict[str, str] | None = None) -> MetricsSnapshot:
        response = await self.client.get("/metrics", headers=headers)
        response.raise_for_status()
        return parse_metrics(response.text)


def settings_from_args(args: list[str]) -> dict[str, Any]:
    """``sluicegate serve`` flags as settings (``--max-num-seqs 4`` -> ``max_num_seqs='4'``,
    ``--no-pause`` -> ``pause=False``, a repeated flag -> a list), so that a test written
    against a server process reads the same in process.  Values stay strings: the
    settings parse them as the CLI does."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"not a flag: {flag!r}"
        name = flag[2:].replace("-", "_")
        value: Any
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 2
        elif name.startswith("no_"):
            name, value, i = name[3:], False, i + 1
        else:
            value, i = True, i + 1
        if name in out:
            previous = out[name]
            out[name] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            out[name] = value
    return out


@contextlib.asynccontextmanager
async def serve_in_process(
    *args: str, ready_timeout_seconds: float = 60.0, **settings: Any
) -> AsyncIterator[InProcessApp]:
    """The app with ``settings`` (over :data:`FAST_SIM`; ``args`` as ``serve`` flags),
    ready.  Its stages stop when the block ends."""
    values = {**FAST_SIM, **settings_from_args(list(args)), **settings}
    config = values.pop("config", None)
    if isinstance(config, Path):
        config = str(config)
    app = create_app(load_settings(config, **values))
    state = app.state.sluicegate
    assert isinstance(state, AppState)
    async with app.router.lifespan_context(app):
        async with asyncio.timeout(ready_timeout_seconds):
            while state.ready is None:
                if state.load_error is not None:
                    raise RuntimeError(state.load_error)
                await asyncio.sleep(0.005)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield InProcessApp(app, state, client)
