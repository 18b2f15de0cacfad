"""An upstream of a pool answered in memory (httpx's ``MockTransport``), with no socket:
for tests of the relay and of the start-up probe whose answers the test times itself."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx

from sluicegate.engine.upstream.pool import Upstream

#: What the upstream sends for a request: an event stream's bytes, or an iterator of them.
Answer = Callable[[httpx.Request], bytes | AsyncIterator[bytes]]


async def answer_in_memory(upstream: Upstream, answer: Answer, model: str) -> None:
    """Point ``upstream`` at ``answer`` (200, ``text/event-stream``), healthy and serving
    ``model``."""
    base_url = upstream.client.base_url

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=answer(request)
        )

    await upstream.client.aclose()
    upstream.client = httpx.AsyncClient(base_url=base_url, transport=httpx.MockTransport(respond))
    upstream.healthy = True
    upstream.models = [model]
