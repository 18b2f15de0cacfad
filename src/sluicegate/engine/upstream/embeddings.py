"""``POST /v1/embeddings`` relayed to an upstream that lists the model as an embedding
model (``task: "embed"`` in its /v1/models).

An embeddings request is one short call, not a stream: it takes no seat of the pool's
limits (an upstream's embedding model is not its chat engine's batch), goes to the
healthy upstream holding the least, and on a connection failure or a 5xx to the next;
the upstream's own answer, a 4xx included, reaches the client as it was sent.
"""

from __future__ import annotations

import httpx

from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.errors import APIError


def embedding_models(pool: UpstreamPool) -> list[str]:
    """Every embedding model some upstream lists."""
    seen: dict[str, None] = {}
    for upstream in pool.upstreams:
        for model in upstream.embedding_models:
            seen.setdefault(model)
    return list(seen)


async def relay_embeddings(pool: UpstreamPool, model: str, body: bytes) -> tuple[int, bytes]:
    """The status and body of the first upstream serving ``model`` that answers; a 404
    when none lists it, a 502 ``upstream_failed`` when none answers."""
    serving = [u for u in pool.upstreams if model in u.embedding_models]
    candidates = sorted((u for u in serving if u.healthy), key=lambda u: u.load)
    if not serving:
        raise APIError(
            404,
            f"The model '{model}' is not an embedding model of any upstream (see GET /v1/models).",
            param="model",
            code="model_not_found",
        )
    settings = pool.settings
    timeout = httpx.Timeout(
        settings.upstream_idle_timeout_seconds, connect=settings.upstream_connect_timeout_seconds
    )
    failures: list[str] = []
    for upstream in candidates:
        try:
            response = await upstream.client.post(
                "/v1/embeddings",
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout,
            )
        except httpx.HTTPError as exc:
            pool.failed(upstream, f"embeddings: {exc!r}")
            failures.append(f"{upstream.name}: {exc!r}")
            continue
        if response.status_code >= 500:
            pool.failed(upstream, f"embeddings: HTTP {response.status_code}")
            failures.append(f"{upstream.name}: HTTP {response.status_code}")
            continue
        upstream.consecutive_failures = 0  # (its chat limit is not the embeddings')
        return response.status_code, response.content
    raise APIError(
        502,
        f"No upstream serving '{model}' answered the embeddings request"
        + (f" ({'; '.join(failures)})" if failures else " (none is healthy)")
        + "; retry later.",
        code="upstream_failed",
    )
