"""What a llama.cpp upstream says of itself in its ``/props``: the context of one slot
(what one request gets; its ``/v1/models`` gives the model's training context only) and
its slots (``total_slots``, its ``-np``): how many it runs at once, so its limit is
never more (an 8-slot llama-server given 10 queues two inside, where no prediction of
its time to first token sees them)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass(slots=True, frozen=True)
class LlamaProps:
    """One slot's context and the slots (None: not said)."""

    slot_context: int | None
    slots: int | None


async def llama_props(client: httpx.AsyncClient, timeout_seconds: float) -> LlamaProps:
    """What the upstream at ``client`` says in its ``/props`` (nothing, if it has none)."""
    try:
        response = await client.get("/props", timeout=timeout_seconds)
        props = response.json()
        settings = props.get("default_generation_settings") or {}
        n_ctx = settings.get("n_ctx")
        slots = props.get("total_slots")
    except (httpx.HTTPError, ValueError, AttributeError):
        return LlamaProps(None, None)
    return LlamaProps(
        n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None,
        slots if isinstance(slots, int) and slots > 0 else None,
    )
