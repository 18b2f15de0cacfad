"""The upstream core: each dispatched request relayed from an upstream, behind the same
:class:`~sluicegate.engine.base.EngineCore` protocol as the embedded core.

Each request is one task on the event loop.  It picks an upstream (the pool's routing),
streams the answer from it and puts each delta into the request's stream, counting the
text's tokens with Sluicegate's tokenizer (the counts that limits and admission use; a
byte-level BPE tokenizer decodes exactly the text it encoded, so the tokens are also
what a resume continues from).  One call is :class:`~.relay.Relay`'s.

* **Pause**: a paused request stops reading its upstream response, so the upstream's
  socket fills and TCP holds it back, and its seat is lent out (as the embedded engine
  lends a paused sequence's).  When a request needs its upstream place (or after
  ``pause_preempt_seconds``, when set), the upstream request is closed, freeing the place
  and the engine's KV; on resume it is continued by a continuation request (the partial
  answer appended, :func:`~sluicegate.engine.upstream.wire.request_body`).  The
  request's own pause state (``Request.pause``) is the one record of it.
* **Cancel**: the task is cancelled, which closes the upstream connection at once.
* **Failure**: an upstream that refuses (429/503), fails (5xx, connection error), hangs
  before its first token or goes silent mid-answer is left for another: before any text
  the request is simply sent again; after some, it is continued there (text of one
  choice), or asked again and what its client has skipped (tool calls, several choices:
  :mod:`~sluicegate.engine.upstream.choices`), and the client sees one stream.  An
  upstream's 4xx reaches the client as it is (its own validation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from sluicegate.config import Settings
from sluicegate.engine.base import CoreFeatures, CoreHooks, CoreStats
from sluicegate.engine.output import RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.upstream import embeddings
from sluicegate.engine.upstream.estimate import calibrate, pool_estimate
from sluicegate.engine.upstream.live import ClientError, Live, Outcome
from sluicegate.engine.upstream.pool import Upstream, UpstreamPool
from sluicegate.engine.upstream.relay import PAUSE_CHECK_SECONDS, Relay, post
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import FinishReason, Request
from sluicegate.scheduler.seat_limit import ServiceEstimate

logger = logging.getLogger(__name__)

#: Tokens of the byte-level tokenizer (256 bytes and ChatML's specials): counts in bytes.
BYTE_VOCAB_SIZE = 259

#: A request gives up after this many failed calls per upstream of the pool (an upstream
#: that fails it on every call, and passes its health checks between, would hold its
#: stream for ever).
MAX_FAILED_CALLS_PER_UPSTREAM = 3

#: The long prompt an upstream's TTFT is measured with at start (about 256 tokens).
PROBE_TEXT = " ".join(
    ["The quick brown fox jumps over the lazy dog while the river runs to the sea."] * 16
)


class UpstreamCore:
    """Relays dispatched requests from the pool.  Owned by the event loop."""

    def __init__(
        self,
        pool: UpstreamPool,
        tokenizer: TextTokenizer,
        settings: Settings,
        hooks: CoreHooks | None = None,
        *,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.settings = settings
        self._capacity = DispatchCapacity(
            sum(u.max_concurrent for u in settings.upstream_configs) or 1, 1 << 62, 1
        )
        self._max_model_len = max_model_len
        self._hooks = hooks or CoreHooks()
        self.relay = Relay(pool, tokenizer, settings, clock=clock, sleep=sleep)
        self._live: dict[str, Live] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set when an upstream place may have freed.
        self._room = asyncio.Event()
        #: Measuring the upstreams' latencies (in the background until one is healthy).
        self._measuring: asyncio.Task[None] | None = None
        pool.on_change = self._pool_changed

    # ----------------------------------------------------------- the protocol
    @property
    def features(self) -> CoreFeatures:
        return CoreFeatures(relays=True)

    @property
    def capacity(self) -> DispatchCapacity:
        return self._capacity

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def model_max_len(self, model: str) -> int:
        """The context a served model takes, as requests are checked against it: what
        its upstreams say (the least of them), within ``max_model_len`` when one is
        configured.  A gateway counting bytes (no model tokenizer) counts several times
        a model's tokens: it checks nothing of its own and leaves it to the upstream."""
        known = self.pool.max_model_len(model)
        if known is None or self.tokenizer.vocab_size <= BYTE_VOCAB_SIZE:
            return self._max_model_len
        return min(known, self._max_model_len)

    @property
    def model_names(self) -> list[str]:
        return self.pool.served_models()

    @property
    def embedding_models(self) -> list[str]:
        return embeddings.embedding_models(self.pool)

    async def relay_embeddings(self, model: str, body: bytes) -> tuple[int, bytes]:
        return await embeddings.relay_embeddings(self.pool, model, body)

    async def start(self, on_measured: Callable[[], None] | None = None) -> None:
        """Check every upstream once (which sizes the seats), then measure them: at once
        when one is healthy, else in the background as soon as one is (until then the
        estimate holds priors)."""
        await self.pool.start()
        self._pool_changed()
        self._measuring = asyncio.create_task(self._measure(on_measured))
        if self.pool.num_healthy:
            await self._measuring
        logger.info(
            "engine upstream ready: %d of %d upstreams healthy (%s), serving %s",
            self.pool.num_healthy,
            len(self.pool.upstreams),
            ", ".join(u.name for u in self.pool.upstreams),
            self.model_names or "no model yet",
        )

    async def close(self) -> None:
        if self._measuring is not None:
            self._measuring.cancel()
        tasks = list(self._tasks.values())
        for live in list(self._live.values()):
            post(live, FinishReason.ERROR, error="server shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.close()

    def estimate(self) -> ServiceEstimate:
        """What admission predicts with: the pool's places and measured latencies."""
        relay = self.relay
        return pool_estimate(
            self.pool,
            self._capacity.seat_limit,
            relay.mean_prompt,
            relay.mean_output,
            shared_prefill=self.settings.upstream_prefill == "together",
        )

    def add_request(
        self, request: Request, stream: RequestStream, call: UpstreamCall | None = None
    ) -> None:
        if call is None:  # cannot happen: a relaying core's requests are prepared with one
            raise TypeError("an upstream request needs its upstream call")
        live = Live(request, stream, call)
        if request.first_scheduled_time is None:  # its queue wait ends here
            request.first_scheduled_time = time.monotonic()
        if request.num_output_tokens:
            # Taken over from another replica: its client has this text already.
            live.answer.choice(0).text.append(self.tokenizer.decode(request.output_token_ids))
            live.taken_over = True
        rid = request.request_id
        self._live[rid] = live
        self._tasks[rid] = asyncio.get_running_loop().create_task(
            self._serve(live), name=f"upstream-{rid}"
        )

    def abort_request(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            # Checked at every line too: a cancellation can be lost (on Python 3.11 an
            # ``asyncio.wait_for`` whose inner read completes in the same loop iteration
            # returns its result and drops the cancellation), and the relay must end.
            live.aborted = True
            live.wake.set()
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def pause_request(self, request_id: str) -> None:
        """A slow reader: stop reading its upstream, and lend its seat out (it keeps its
        upstream place until a request needs it, or ``pause_preempt_seconds``)."""
        live = self._live.get(request_id)
        if live is not None and live.pause(time.monotonic()):
            self._capacity.set_idle(request_id, True)

    def resume_request(self, request_id: str) -> None:
        live = self._live.get(request_id)
        seconds = None if live is None else live.resume(time.monotonic())
        if seconds is not None:
            self._capacity.set_idle(request_id, False)
            if self._hooks.on_resume is not None:
                self._hooks.on_resume(seconds)

    def stats(self) -> CoreStats:
        lives = list(self._live.values())
        paused = sum(1 for live in lives if live.paused)
        preemptions = self.relay.preemptions
        estimate = self.estimate()
        return CoreStats(
            num_running=len(lives) - paused,
            num_waiting=0,
            num_paused=paused,
            num_throttled=0,
            num_waiting_by_priority={},
            num_preemptions_total=preemptions,
            preemptions_by_reason={"pause": preemptions} if preemptions else {},
            num_steps=self.relay.num_calls,
            engine_up=True,
            sections={
                "seats": {
                    "seat_limit": self._capacity.seat_limit,
                    "healthy_upstreams": self.pool.num_healthy,
                    "predicted_step_seconds": estimate.step_seconds,
                },
                "upstreams": self.pool.snapshot(),
            },
        )

    # ------------------------------------------------------------ the pool
    async def _measure(self, on_measured: Callable[[], None] | None) -> None:
        await self.pool.any_healthy.wait()
        await calibrate(
            self.pool,
            self.tokenizer,
            PROBE_TEXT,
            self.settings.upstream_first_token_timeout_seconds,
            self.settings.upstream_max_event_bytes,
        )
        if on_measured is not None:
            on_measured()

    def _pool_changed(self) -> None:
        """A limit changed, an upstream came or went, or other replicas took or left
        places: the seats follow the places, and a request waiting for one looks again."""
        pool = self.pool
        # None where other replicas hold every place: requests wait in this queue, not
        # for a place inside _find_room, where admission's prediction does not see them.
        taken = pool.share is not None and pool.num_healthy > 0
        self._capacity.set_seat_limit(pool.total_limit, floor=0 if taken else 1)
        self._room.set()
        if self._capacity.on_change is not None:
            self._capacity.on_change()

    # ------------------------------------------------------------- one request
    async def _serve(self, live: Live) -> None:
        rid = live.request.request_id
        try:
            await self._relay_until_done(live)
        except asyncio.CancelledError:
            post(live, FinishReason.ABORT)
        except ClientError as error:
            post(live, FinishReason.ERROR, failure=error.error)
        except Exception as exc:  # a bug here must not hang the client's stream
            logger.exception("relaying %s failed", rid)
            post(live, FinishReason.ERROR, error=f"the gateway failed: {exc!r}")
        finally:
            self._live.pop(rid, None)
            self._tasks.pop(rid, None)
            self._capacity.release(rid)

    async def _relay_until_done(self, live: Live) -> None:
        """Call upstreams until one answers it whole.  Every way out ends its stream: an
        answer, or (raised, and posted by :meth:`_serve`) an error; a request its
        upstreams keep failing gives up after ``MAX_FAILED_CALLS_PER_UPSTREAM`` failed
        calls per upstream, even when the same one comes back healthy each time."""
        rid = live.request.request_id
        while True:
            upstream = await self._place(live)
            # Mid-answer, moved from the upstream that failed it (counted there).
            previous = None if live.upstream == upstream.name else live.upstream
            if previous is not None and live.delivered and (failed := self.pool.by_name(previous)):
                failed.failovers_total += 1
            live.upstream = upstream.name
            live.holding = upstream
            try:
                outcome = await self.relay.call(live, upstream)
            finally:
                live.holding = None
                self.pool.release(upstream, rid)
                self._room.set()
            if outcome is Outcome.FINISHED:
                return
            if outcome is Outcome.PREEMPTED:
                # Its seat stays lent out until its reader catches up.
                await live.running.wait()
                live.preempted = False
            elif live.num_failed_calls >= MAX_FAILED_CALLS_PER_UPSTREAM * len(self.pool.upstreams):
                raise ClientError(_gave_up(live))

    async def _place(self, live: Live) -> Upstream:
        """An upstream with a place for it, held (waiting for one if need be; raises if
        none comes).  With other gateway replicas the place is claimed in the shared
        count: one they took first means waiting for the next."""
        rid = live.request.request_id
        while True:
            upstream = self._choose(live) or await self._find_room(live)
            if upstream is None:
                raise ClientError(self._unavailable(live))
            self.pool.hold(upstream, rid, live.request.max_total_tokens)
            if await self.pool.claim(upstream):
                return upstream
            self.pool.unhold(upstream, rid)

    def _choose(self, live: Live) -> Upstream | None:
        return self.pool.choose(
            live.call.model, live.request.max_total_tokens, live.affinity_key, live.excluded
        )

    async def _find_room(self, live: Live) -> Upstream | None:
        """No upstream has a place for it now.  Places held by paused requests are taken
        back (they continue later); mid-answer, a failed upstream is tried again once its
        health check passes.  Waits up to the first-token (or, mid-answer, the idle)
        timeout; None if nothing freed."""
        timeout = (
            self.settings.upstream_idle_timeout_seconds
            if live.delivered
            else self.settings.upstream_first_token_timeout_seconds
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            others = [
                u
                for u in self.pool.upstreams
                if u.healthy and u.serves(live.call.model) and u.name not in live.excluded
            ]
            if not others and not live.delivered:
                return None  # every upstream that could serve it failed it: say so now
            self._reclaim(live)
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PAUSE_CHECK_SECONDS):
                    await self._room.wait()
            if live.delivered:
                live.excluded = {
                    name
                    for name in live.excluded
                    if (u := self.pool.by_name(name)) is None or not u.healthy
                }
            upstream = self._choose(live)
            if upstream is not None:
                return upstream
        return None

    def _reclaim(self, live: Live) -> None:
        """Ask the longest-paused request holding a place this one could use to let go."""
        candidates = [
            other
            for other in self._live.values()
            if other is not live
            and other.paused
            and not other.preempted
            and other.holding is not None
            and other.holding.serves(live.call.model)
            and other.holding.name not in live.excluded
        ]
        if candidates:
            victim = min(candidates, key=lambda other: other.request.pause.since)
            victim.preempted = True
            victim.wake.set()

    def _unavailable(self, live: Live) -> APIError:
        healthy = self.pool.num_healthy
        what = (
            "no upstream is healthy"
            if not healthy
            else f"every upstream serving '{live.call.model}' is full or failing"
        )
        retry = max(1, round(self.settings.upstream_health_interval_seconds))
        return APIError(
            503,
            f"The request could not be served: {what}. Retry shortly.",
            code="upstream_unavailable",
            headers={"retry-after": str(retry)},
        )


def _gave_up(live: Live) -> APIError:
    return APIError(
        502,
        f"The upstreams failed this request {live.num_failed_calls} times (the last: "
        f"{live.last_failure}): the stream ends here rather than wait on. Send the "
        "request again.",
        code="upstream_failed",
    )
