"""The pool of upstreams: each one's limit, load, health and measured latency, and the
choice of where a request goes.

**Limits.** Each upstream takes at most its limit of requests at once, so that requests
wait in Sluicegate's fair queue (bounded, fair, able to say when to come back), not inside
the engines.  The limit starts at the configured ``max_concurrent`` and adapts: it is cut
multiplicatively when the upstream pushes back (429/503), when its own metrics show a
waiting line (vLLM's ``num_requests_waiting``, TGI's queue size, llama.cpp's deferred
requests, another Sluicegate's waiting requests), or when its measured time per output
token passes the objective; it grows back by one while the upstream is full and keeps up.

**Routing.** Least outstanding tokens (prompt + ``max_tokens`` of every request it
holds, over its weight), among the healthy upstreams with a free place.  With prefix
affinity, requests that share their first message (the system prompt) go to the
upstream a rendezvous hash picks for it, for its prefix cache, unless that one holds
clearly more work than the least loaded.

**Health.** Every ``upstream_health_interval_seconds`` each upstream's ``/v1/models`` is
read (it also gives the models it serves) and its ``/metrics`` if it has them.
``upstream_eject_failures`` consecutive failures (of checks or of requests) eject it: it
gets no requests until a check succeeds again.  Owned by the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from sluicegate.config import Settings
from sluicegate.engine.upstream.network import bounded_transport
from sluicegate.engine.upstream.props import llama_props
from sluicegate.engine.upstream.share import HeldElsewhere, PoolShare
from sluicegate.engine.upstream.signals import (
    Latency,
    PrefillLedger,
    context_length,
    load_signals,
    split_models,
)
from sluicegate.upstream_settings import ContinueStyle, UpstreamConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Upstream:
    """One backend: its client, limit, load and health."""

    config: UpstreamConfig
    client: httpx.AsyncClient
    limit: int
    healthy: bool = False
    consecutive_failures: int = 0
    #: Request id -> tokens (prompt + max_tokens) it holds.
    outstanding: dict[str, int] = field(default_factory=dict)
    outstanding_tokens: int = 0
    #: Its own model names (from /v1/models).
    models: list[str] = field(default_factory=list)
    #: Its own model name -> the context it takes, when its /v1/models says.
    context_lengths: dict[str, int] = field(default_factory=dict)
    #: Its embedding models (``POST /v1/embeddings`` is relayed to them).
    embedding_models: list[str] = field(default_factory=list)
    waiting_inside: float = 0.0
    kv_usage: float | None = None
    latency: Latency = field(default_factory=Latency)
    prefill: PrefillLedger = field(default_factory=PrefillLedger)
    requests_total: int = 0
    failures_total: int = 0
    aborts_total: int = 0
    failovers_total: int = 0
    pushbacks_total: int = 0
    #: Answers it broke the protocol in (past max_tokens, an event too large), by reason.
    protocol_errors: dict[str, int] = field(default_factory=dict)
    #: It refused a chat continuation (``continue_final_message``): under ``auto`` it
    #: continues chats on ``/v1/completions`` from now on.
    refused_chat_continuation: bool = False
    #: The most it held without a line inside it, as last seen (growth above it waits).
    ceiling: int | None = None
    #: How many it says it runs at once (another Sluicegate's concurrency limit): never
    #: more than that.
    reported_seats: int | None = None
    #: Requests the other gateway replicas hold there, and how many they are
    #: (:mod:`.share`; 0 alone).
    held_elsewhere: int = 0
    replicas_elsewhere: int = 0
    #: The places this replica may fill there until the next exchange (None: alone).
    allowance: int | None = None
    _ceiling_time: float = -math.inf
    _last_grow: float = -math.inf
    _last_cut: float = -math.inf

    @property
    def name(self) -> str:
        return self.config.label

    @property
    def load(self) -> float:
        """Tokens it holds, per unit of its weight (routing goes to the least)."""
        return self.outstanding_tokens / self.config.weight

    @property
    def held(self) -> int:
        """Requests it holds from every replica (this one's and the others')."""
        return len(self.outstanding) + self.held_elsewhere

    @property
    def has_room(self) -> bool:
        return self.healthy and self.held < self.limit

    @property
    def places_here(self) -> int:
        """Places this replica may fill: alone, the limit less what others hold; beside
        live replicas, its :attr:`allowance`."""
        if self.allowance is None:
            return max(0, self.limit - self.held_elsewhere)
        return self.allowance

    def upstream_model(self, served: str) -> str:
        """The upstream's name for a served model."""
        return self.config.models.get(served, served)

    @property
    def continue_style(self) -> ContinueStyle:
        style = self.config.continuation
        return "completion" if style == "auto" and self.refused_chat_continuation else style

    def serves(self, served: str) -> bool:
        if self.config.models:
            return served in self.config.models
        return served in self.models

    def served_models(self) -> list[str]:
        return list(self.config.models) if self.config.models else list(self.models)

    def max_model_len(self, served: str) -> int | None:
        """The context it takes for a served model (None: it does not say).  An upstream
        of one model answers to any name (llama.cpp lists its file's path): that one's."""
        lengths = self.context_lengths
        found = lengths.get(self.upstream_model(served))
        if found is None and len(lengths) == 1 and len(self.models) == 1:
            return next(iter(lengths.values()))
        return found

    def cut(self, reason: str, now: float, to: int | None = None) -> None:
        """Take the limit down (at most once a second, so one burst of pushback is one cut)."""
        if now - self._last_cut < 1.0:
            return
        self._last_cut = now
        before = self.limit
        target = math.floor(self.limit * 0.75) if to is None else to
        self.limit = max(1, min(self.limit - 1, target))
        if self.limit != before:
            logger.info("upstream %s: limit %d -> %d (%s)", self.name, before, self.limit, reason)

    def grow(self, now: float) -> None:
        """One more place, while it is full and keeping up (at most every 2 s; above the
        level at which a line last formed inside it, only after 30 s without a cut)."""
        if self.limit >= self.config.max_concurrent or now - self._last_grow < 2.0:
            return
        if self.reported_seats is not None and self.limit >= self.reported_seats:
            return
        if now - self._last_cut < 5.0 or self.held < self.limit:
            return
        probing = self.ceiling is not None and self.limit >= self.ceiling
        if probing and now - max(self._last_cut, self._ceiling_time) < 30.0:
            return
        if self.waiting_inside >= 1:  # its own line is not empty: it is full already
            return
        self._last_grow = now
        self.limit += 1

    def snapshot(self) -> dict[str, object]:
        return {
            "url": self.config.url,
            "healthy": self.healthy,
            "limit": self.limit,
            "max_concurrent": self.config.max_concurrent,
            "outstanding_requests": len(self.outstanding),
            "held_elsewhere": self.held_elsewhere,
            "replicas_elsewhere": self.replicas_elsewhere,
            "outstanding_tokens": self.outstanding_tokens,
            "waiting_inside": self.waiting_inside,
            "kv_usage": self.kv_usage,
            "ttft_seconds": _round(self.latency.ttft_seconds),
            "tpot_seconds": _round(self.latency.tpot_seconds),
            "models": self.served_models(),
            "continuation": self.continue_style,
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "aborts_total": self.aborts_total,
            "failovers_total": self.failovers_total,
            "pushbacks_total": self.pushbacks_total,
        }


class UpstreamPool:
    """Every upstream, the routing choice and the health loop."""

    def __init__(
        self,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        tpot_objective_seconds: float | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self.tpot_objective_seconds = tpot_objective_seconds
        timeout = httpx.Timeout(
            connect=settings.upstream_connect_timeout_seconds,
            read=None,
            write=10.0,
            pool=settings.upstream_connect_timeout_seconds,
        )
        self.upstreams = [
            Upstream(
                config,
                httpx.AsyncClient(
                    base_url=config.url,
                    timeout=timeout,
                    headers=_auth(config),
                    transport=bounded_transport(
                        httpx.Limits(
                            max_connections=config.max_concurrent + 4,
                            max_keepalive_connections=config.max_concurrent + 4,
                        )
                    ),
                ),
                limit=config.max_concurrent,
            )
            for config in settings.upstream_configs
        ]
        #: Called when room may have appeared (a limit grew, an upstream came back).
        self.on_change: Callable[[], None] | None = None
        #: Set once some upstream has passed a health check.
        self.any_healthy = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: The places other gateway replicas hold, through a shared Redis store.
        self.share: PoolShare | None = None
        interval = settings.upstream_share_interval_seconds
        if settings.store.startswith(("redis://", "rediss://", "unix://")) and interval > 0:
            held = HeldElsewhere(settings.store, interval)
            self.share = PoolShare(held, self.upstreams, self._changed)

    # --- lifecycle ---

    async def start(self) -> None:
        """Check every upstream once (so the model list is known), then keep checking."""
        await asyncio.gather(*(self.check(u) for u in self.upstreams))
        self._task = asyncio.create_task(self._health_loop(), name="sluicegate-upstream-health")
        if self.share is not None:
            await self.share.start()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.share is not None:
            await self.share.close()
        await asyncio.gather(*(u.client.aclose() for u in self.upstreams))

    # --- what the pool serves ---

    def served_models(self) -> list[str]:
        seen: dict[str, None] = {}
        for upstream in self.upstreams:
            for model in upstream.served_models():
                seen.setdefault(model)
        return list(seen)

    def max_model_len(self, served: str) -> int | None:
        """The context a served model takes: the least any upstream serving it says
        (None: none says)."""
        known = [
            length
            for u in self.upstreams
            if u.serves(served) and (length := u.max_model_len(served)) is not None
        ]
        return min(known) if known else None

    @property
    def total_limit(self) -> int:
        """Places this replica may fill at the healthy upstreams (their limits, less what
        other replicas hold and their share of the free places)."""
        return sum(u.places_here for u in self.upstreams if u.healthy)

    @property
    def num_healthy(self) -> int:
        return sum(1 for u in self.upstreams if u.healthy)

    def by_name(self, name: str) -> Upstream | None:
        return next((u for u in self.upstreams if u.name == name), None)

    # --- routing ---

    def choose(
        self, model: str, tokens: int, affinity_key: str | None, exclude: set[str]
    ) -> Upstream | None:
        """The upstream for a request of ``tokens`` (None: none healthy with room)."""
        eligible = [
            u for u in self.upstreams if u.has_room and u.serves(model) and u.name not in exclude
        ]
        if not eligible:
            return None
        least = min(eligible, key=lambda u: u.load)
        if affinity_key is None or not self.settings.upstream_prefix_affinity:
            return least
        preferred = max(eligible, key=lambda u: _rendezvous(affinity_key, u))
        # Affinity yields when the preferred one holds clearly more than the least loaded:
        # more than one typical request's tokens over it, and 1.5 times its load.
        slack = max(tokens, 1)
        if preferred.load <= 1.5 * least.load + slack / preferred.config.weight:
            return preferred
        return least

    def hold(self, upstream: Upstream, request_id: str, tokens: int) -> None:
        upstream.outstanding[request_id] = tokens
        upstream.outstanding_tokens += tokens
        upstream.requests_total += 1

    async def claim(self, upstream: Upstream) -> bool:
        """With other replicas: take the place the last :meth:`hold` asked for there, in
        the shared count (False: another replica took the last one first).  Alone: yes."""
        return self.share is None or await self.share.claim(upstream)

    def unhold(self, upstream: Upstream, request_id: str) -> None:
        """Undo a :meth:`hold` whose place another replica took first."""
        if request_id in upstream.outstanding:
            upstream.requests_total -= 1
        self.release(upstream, request_id)

    def release(self, upstream: Upstream, request_id: str) -> None:
        tokens = upstream.outstanding.pop(request_id, None)
        if tokens is not None:
            upstream.outstanding_tokens -= tokens
            if self.share is not None:
                self.share.let_go()
        self._changed()

    # --- outcomes ---

    def succeeded(self, upstream: Upstream) -> None:
        upstream.consecutive_failures = 0
        if self.tpot_objective_seconds is not None:
            tpot = upstream.latency.tpot_seconds
            if tpot is not None and tpot > self.tpot_objective_seconds:
                upstream.cut(f"TPOT {tpot * 1e3:.0f} ms over the objective", self._clock())
                return
        before = upstream.limit
        upstream.grow(self._clock())
        if upstream.limit > before:
            self._changed()

    def failed(self, upstream: Upstream, reason: str) -> None:
        upstream.failures_total += 1
        upstream.consecutive_failures += 1
        if not upstream.healthy and upstream.consecutive_failures == 1:
            logger.warning("upstream %s not healthy: %s", upstream.name, reason)
        if (
            upstream.healthy
            and upstream.consecutive_failures >= self.settings.upstream_eject_failures
        ):
            upstream.healthy = False
            logger.warning("upstream %s ejected: %s", upstream.name, reason)

    def pushed_back(self, upstream: Upstream, status: int) -> None:
        """It answered 429 or 503: it is fuller than its limit says."""
        upstream.pushbacks_total += 1
        upstream.cut(f"it answered {status}", self._clock(), to=len(upstream.outstanding) - 1)

    # --- health ---

    async def check(self, upstream: Upstream) -> None:
        """Read its model list (health) and its metrics (load), when it has them."""
        try:
            upstream.models, upstream.context_lengths = await self._models(upstream)
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            self.failed(upstream, f"health check: {exc!r}")
            return
        came_back = not upstream.healthy
        upstream.healthy = True
        self.any_healthy.set()
        upstream.consecutive_failures = 0
        if came_back:
            logger.info("upstream %s healthy: models %s", upstream.name, upstream.models)
            self._changed()
        await self._read_load(upstream)

    async def _models(self, upstream: Upstream) -> tuple[list[str], dict[str, int]]:
        """Its model names and the contexts they take, from its /v1/models.  When that
        fails (``transformers serve`` without a hub cache) but its models are configured,
        its /health says whether it is up.  Raises when it is not."""
        timeout = self.settings.upstream_connect_timeout_seconds
        try:
            response = await upstream.client.get("/v1/models", timeout=timeout)
            response.raise_for_status()
            data = response.json().get("data", [])
            entries, upstream.embedding_models = split_models(data)
            lengths = {
                str(m["id"]): length for m in entries if (length := context_length(m)) is not None
            }
            if any("meta" in m for m in entries):  # llama.cpp: a slot holds less
                props = await llama_props(
                    upstream.client, self.settings.upstream_connect_timeout_seconds
                )
                if props.slots is not None:  # its slots: the most it runs at once
                    upstream.reported_seats = props.slots
                    upstream.limit = min(upstream.limit, props.slots)
                slot = props.slot_context
                if slot is not None:
                    lengths = {name: min(length, slot) for name, length in lengths.items()}
            return [str(m["id"]) for m in entries], lengths
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
            if not upstream.config.models or isinstance(exc, httpx.ConnectError):
                raise
        try:
            health = await upstream.client.get("/health", timeout=timeout)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # It closed the connection after its 500 without saying so (uvicorn does,
            # after an exception): ask again, on a new one.
            health = await upstream.client.get("/health", timeout=timeout)
        health.raise_for_status()
        return list(upstream.config.models.values()), {}

    async def _read_load(self, upstream: Upstream) -> None:
        try:
            response = await upstream.client.get(
                "/metrics", timeout=self.settings.upstream_connect_timeout_seconds
            )
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            return
        waiting, kv, seats = load_signals(response.text)
        if waiting is None:
            return
        before, upstream.waiting_inside = upstream.waiting_inside, waiting
        upstream.kv_usage = kv
        # A line inside it on two reads running: it holds more than it runs.  Queue here
        # instead.  (Arrivals wait a step inside any engine: one or two waiting, or a fifth
        # of what it holds, is not yet a line.)
        lasting = min(before, waiting)
        now = self._clock()
        held = upstream.held  # every replica's: the line is theirs too
        if held and lasting >= max(2.0, 0.2 * held):
            runs = max(1, held - math.ceil(lasting))
            upstream.ceiling, upstream._ceiling_time = runs, now
            upstream.cut(f"{lasting:g} requests waiting inside it", now, to=runs)
        if seats is not None:
            # Another Sluicegate says how many it runs at once: no more than that.
            upstream.reported_seats = max(1, int(seats))
            upstream.limit = min(upstream.limit, upstream.reported_seats)

    async def _health_loop(self) -> None:
        interval = self.settings.upstream_health_interval_seconds
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self.check(u) for u in self.upstreams))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {u.name: u.snapshot() for u in self.upstreams}


def _rendezvous(key: str, upstream: Upstream) -> float:
    """Weighted rendezvous hashing: each key prefers one upstream, stably."""
    digest = hashlib.blake2b(f"{key}|{upstream.name}".encode(), digest_size=8).digest()
    unit = (int.from_bytes(digest, "big") + 1) / 2.0**64
    return -upstream.config.weight / math.log(unit)


def _auth(config: UpstreamConfig) -> dict[str, str]:
    if config.api_key is None:
        return {}
    return {"authorization": f"Bearer {config.api_key.get_secret_value()}"}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
