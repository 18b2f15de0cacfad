"""The upstream engine core: each dispatched request relayed from an upstream, with the
same interface the service drives the embedded engine's core by.

Each request is one task on the event loop.  It picks an upstream (the pool's routing),
streams the answer from it and puts each delta into the request's stream, counting the
text's tokens with Sluicegate's tokenizer (the counts that limits and admission use; a
byte-level BPE tokenizer decodes exactly the text it encoded, so the tokens are also
what a resume continues from).

* **Pause**: a paused request stops reading its upstream response, so the upstream's
  socket fills and TCP holds it back, and its seat is lent out (as the embedded engine
  lends a paused sequence's).  When a request needs its upstream place (or after
  ``pause_preempt_seconds``, when set), the upstream request is closed, freeing the place
  and the engine's KV; on resume it is continued by a continuation request (the partial
  answer appended, :func:`~sluicegate.engine.upstream.wire.request_body`).
* **Cancel**: the task is cancelled, which closes the upstream connection at once.
* **Failure**: an upstream that refuses (429/503), fails (5xx, connection error), hangs
  before its first token or goes silent mid-answer is left for another: before any text
  the request is simply sent again; after some, it is continued there, and the client
  sees one stream.  An upstream's 4xx reaches the client as it is (its own validation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx

from sluicegate.config import Settings
from sluicegate.engine.core import CoreHooks, EngineCoreStats
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.tokenizer import ChatTemplateError, TextTokenizer
from sluicegate.engine.upstream.estimate import pool_estimate
from sluicegate.engine.upstream.live import ClientError, Live, Outcome
from sluicegate.engine.upstream.pool import Upstream, UpstreamPool
from sluicegate.engine.upstream.wire import Delta, UpstreamCall, error_message, parse_event
from sluicegate.engine.upstream.wire import request_body as build_body
from sluicegate.errors import APIError
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.kv_cache import KVCacheStats
from sluicegate.scheduler.request import FinishReason, Request
from sluicegate.scheduler.scheduler import SchedulerStats
from sluicegate.scheduler.seat_limit import ServiceEstimate

logger = logging.getLogger(__name__)

#: How often a paused request checks whether it should let go of its upstream.
_PAUSE_CHECK_SECONDS = 0.25


class UpstreamCore:
    """Relays dispatched requests from the pool.  Owned by the event loop."""

    def __init__(
        self,
        pool: UpstreamPool,
        tokenizer: TextTokenizer,
        capacity: DispatchCapacity,
        settings: Settings,
        hooks: CoreHooks | None = None,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.settings = settings
        self._hooks = hooks or CoreHooks()
        self._live: dict[str, Live] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Set when an upstream place may have freed.
        self._room = asyncio.Event()
        self.engine_up = True
        self.num_calls = 0
        self.preemptions = 0
        #: A paused request lets go of its upstream after this long (None: only when a
        #: request needs its place).
        self.pause_preempt_seconds = settings.pause_preempt_seconds
        self._mean_prompt = 128.0
        self._mean_output = 64.0

    # ----------------------------------------------------- the service's interface
    def estimate(self) -> ServiceEstimate:
        """What admission predicts with: the pool's places and measured latencies."""
        return pool_estimate(
            self.pool, self.capacity.seat_limit, self._mean_prompt, self._mean_output
        )

    def add_request(self, request: Request, stream: RequestStream) -> None:
        call = request.upstream_call
        if not isinstance(call, UpstreamCall):  # cannot happen: prepare() sets it
            raise TypeError("an upstream request needs its upstream call")
        live = Live(request, stream, call)
        live.running.set()
        if request.first_scheduled_time is None:  # its queue wait ends here
            request.first_scheduled_time = time.monotonic()
        if request.num_output_tokens:
            # Taken over from another replica: its client has this text already.
            live.text.append(self.tokenizer.decode(request.output_token_ids))
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
        if live is not None and live.running.is_set():
            live.running.clear()
            live.paused_since = time.monotonic()
            live.request.paused = True
            self.capacity.set_idle(request_id, True)

    def resume_request(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None and not live.running.is_set():
            live.running.set()
            live.request.paused = False
            self.capacity.set_idle(request_id, False)
            if self._hooks.on_resume is not None:
                self._hooks.on_resume(time.monotonic() - live.paused_since)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for live in list(self._live.values()):
            self._post(live, FinishReason.ERROR, error="server shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.close()

    def stats(self) -> EngineCoreStats:
        lives = list(self._live.values())
        paused = sum(1 for live in lives if not live.running.is_set())
        limit = self.capacity.seat_limit
        scheduler = SchedulerStats(
            num_running=len(lives) - paused,
            num_waiting=0,
            num_paused=paused,
            num_throttled=0,
            kv_cache=KVCacheStats(limit, max(0, limit - len(lives)), 0, 0),
            num_preemptions_total=self.preemptions,
            preemptions_by_reason={"pause": self.preemptions} if self.preemptions else {},
            num_waiting_by_priority={},
        )
        return EngineCoreStats(scheduler, self.num_calls, self.engine_up)

    # ------------------------------------------------------------- one request
    async def _serve(self, live: Live) -> None:
        rid = live.request.request_id
        try:
            await self._relay_until_done(live)
        except asyncio.CancelledError:
            self._post(live, FinishReason.ABORT)
        except ClientError as error:
            self._post(live, FinishReason.ERROR, failure=error.error)
        except Exception as exc:  # a bug here must not hang the client's stream
            logger.exception("relaying %s failed", rid)
            self._post(live, FinishReason.ERROR, error=f"the gateway failed: {exc!r}")
        finally:
            self._live.pop(rid, None)
            self._tasks.pop(rid, None)
            self.capacity.release(rid)

    async def _relay_until_done(self, live: Live) -> None:
        rid = live.request.request_id
        failovers = 0
        while True:
            upstream = self.pool.choose(
                live.call.model, live.request.max_total_tokens, live.affinity_key, live.excluded
            )
            if upstream is None:
                upstream = await self._find_room(live)
            if upstream is None:
                raise ClientError(self._unavailable(live))
            if live.upstream is not None and live.upstream != upstream.name and live.text:
                # Mid-answer, moved from the upstream that failed it (counted there).
                failovers += 1
                if (failed := self.pool.by_name(live.upstream)) is not None:
                    failed.failovers_total += 1
            live.upstream = upstream.name
            live.holding = upstream
            self.pool.hold(upstream, rid, live.request.max_total_tokens)
            try:
                outcome = await self._call(live, upstream)
            finally:
                live.holding = None
                self.pool.release(upstream, rid)
                self._room.set()
            if outcome is Outcome.FINISHED:
                return
            if outcome is Outcome.PREEMPTED:
                await self._wait_to_continue(live)
            elif failovers > 2 * len(self.pool.upstreams):
                raise ClientError(self._unavailable(live))

    async def _find_room(self, live: Live) -> Upstream | None:
        """No upstream has a place for it now.  Places held by paused requests are taken
        back (they continue later); mid-answer, a failed upstream is tried again once its
        health check passes.  Waits up to the first-token (or, mid-answer, the idle)
        timeout; None if nothing freed."""
        timeout = (
            self.settings.upstream_idle_timeout_seconds
            if live.text
            else self.settings.upstream_first_token_timeout_seconds
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            others = [
                u for u in self.pool.upstreams
                if u.healthy and u.serves(live.call.model) and u.name not in live.excluded
            ]  # fmt: skip
            if not others and not live.text:
                return None  # every upstream that could serve it failed it: say so now
            self._reclaim(live)
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_PAUSE_CHECK_SECONDS):
                    await self._room.wait()
            if live.text:
                live.excluded = {
                    name for name in live.excluded
                    if (u := self.pool.by_name(name)) is None or not u.healthy
                }  # fmt: skip
            upstream = self.pool.choose(
                live.call.model, live.request.max_total_tokens, live.affinity_key, live.excluded
            )
            if upstream is not None:
                return upstream
        return None

    def _reclaim(self, live: Live) -> None:
        """Ask the longest-paused request holding a place this one could use to let go."""
        candidates = [
            other for other in self._live.values()
            if other is not live and not other.running.is_set() and not other.preempted
            and other.holding is not None and other.holding.serves(live.call.model)
            and other.holding.name not in live.excluded
        ]  # fmt: skip
        if candidates:
            victim = min(candidates, key=lambda other: other.paused_since)
            victim.preempted = True
            victim.wake.set()

    def _unavailable(self, live: Live) -> APIError:
        healthy = self.pool.num_healthy
        what = (
            "no upstream is healthy" if not healthy
            else f"every upstream serving '{live.call.model}' is full or failing"
        )  # fmt: skip
        retry = max(1, round(self.settings.upstream_health_interval_seconds))
        return APIError(
            503, f"The request could not be served: {what}. Retry shortly.",
            code="upstream_unavailable", headers={"retry-after": str(retry)},
        )  # fmt: skip

    async def _wait_to_continue(self, live: Live) -> None:
        """Preempted: its seat stays lent out until its reader catches up."""
        await live.running.wait()
        live.preempted = False

    async def _call(self, live: Live, upstream: Upstream) -> Outcome:
        request = live.request
        call = live.call
        tokens_left = call.max_tokens - request.num_output_tokens
        if tokens_left <= 0 and live.text:
            self._post(live, FinishReason.LENGTH)
            return Outcome.FINISHED
        continuing_chat = call.kind == "chat" and bool(live.text)
        path, body = build_body(
            call, upstream.upstream_model(call.model), live.partial_text, tokens_left,
            upstream.continue_style, self._render,
        )  # fmt: skip
        self.num_calls += 1
        live.calls += 1
        reported: tuple[int, int] | None = None
        cached = 0
        started = time.monotonic()
        first_time: float | None = None
        last_time = started
        tokens = 0
        try:
            # Until its headers, the first-token timeout (an upstream that hangs before
            # answering at all); the body's reads are timed below.
            until_headers = httpx.Timeout(
                self.settings.upstream_first_token_timeout_seconds,
                connect=self.settings.upstream_connect_timeout_seconds,
            )
            async with upstream.client.stream(
                "POST", path, json=body, timeout=until_headers
            ) as response:
                if response.status_code != 200:
                    if continuing_chat and self._refuses_continuation(upstream, response):
                        return Outcome.RETRY  # at once, as a completion, on the same one
                    return await self._refused(live, upstream, response)
                lines = response.aiter_lines()
                finish: FinishReason | None = None
                while True:
                    if live.aborted:
                        raise asyncio.CancelledError
                    if not live.running.is_set() and await self._stays_paused(live):
                        upstream.aborts_total += 1
                        self.preemptions += 1
                        return Outcome.PREEMPTED
                    timeout = (
                        self.settings.upstream_first_token_timeout_seconds
                        if first_time is None
                        else self.settings.upstream_idle_timeout_seconds
                    )
                    try:
                        # Not asyncio.wait_for: on 3.11 it can swallow a cancellation.
                        async with asyncio.timeout(timeout):
                            line = await anext(lines)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        self.pool.failed(upstream, f"silent for {timeout:g} s")
                        live.excluded.add(upstream.name)
                        return Outcome.RETRY
                    if not line.startswith("data:"):
                        continue
                    delta = parse_event(line[5:].encode())
                    if delta is None:
                        continue
                    if delta.error is not None:
                        self.pool.failed(upstream, f"error event: {delta.error}")
                        live.excluded.add(upstream.name)
                        return Outcome.RETRY
                    if delta.done:
                        break
                    if delta.text:
                        now = time.monotonic()
                        if first_time is None:
                            first_time = now
                        last_time = now
                        tokens += self._deliver(live, delta)
                        await self._keep_pace(live, tokens)
                    if delta.finish_reason is not None:
                        finish = _finish_reason(delta.finish_reason)
                    if delta.prompt_tokens is not None and delta.completion_tokens is not None:
                        reported = (delta.prompt_tokens, delta.completion_tokens)
                        cached = delta.cached_tokens
        except httpx.HTTPError as exc:
            self.pool.failed(upstream, repr(exc))
            live.excluded.add(upstream.name)
            return Outcome.RETRY
        if finish is None:
            # The stream ended without saying how: the upstream died mid-answer.
            self.pool.failed(upstream, "its stream ended without a finish reason")
            live.excluded.add(upstream.name)
            return Outcome.RETRY
        self._mean_prompt += 0.05 * (request.num_prompt_tokens - self._mean_prompt)
        self._mean_output += 0.05 * (max(1, request.num_output_tokens) - self._mean_output)
        upstream.latency.observe(
            request.num_prompt_tokens,
            None if first_time is None or live.preempted else first_time - started,
            (last_time - first_time) / (tokens - 1) if first_time and tokens > 1 else None,
        )
        self.pool.succeeded(upstream)
        # The upstream's own usage, when the whole answer came from this one call.
        whole = live.calls == 1 and not live.taken_over
        if whole:
            self._post(live, finish, reported=reported, cached=cached)
        else:
            self._post(live, finish)
        return Outcome.FINISHED

    def _render(self, messages: list[dict[str, Any]]) -> str | None:
        """The conversation as the model reads it, ready for the answer (the gateway's
        chat template: the upstream model's own when ``upstream_tokenizer`` names it)."""
        try:
            return self.tokenizer.chat_template.render(messages, add_generation_prompt=True)
        except ChatTemplateError:
            return None

    def _refuses_continuation(self, upstream: Upstream, response: httpx.Response) -> bool:
        """A chat continuation refused as invalid by an upstream that took the request
        itself: it does not take ``continue_final_message``.  Under ``auto`` it
        continues chats as completions from now on."""
        status = response.status_code
        if upstream.config.continuation != "auto" or upstream.refused_chat_continuation:
            return False
        if not 400 <= status < 500 or status in (401, 403, 404, 408, 429):
            return False
        upstream.refused_chat_continuation = True
        logger.info("upstream %s refused a chat continuation (%d): continuing chats on "
                    "/v1/completions from now on", upstream.name, status)  # fmt: skip
        return True

    async def _refused(self, live: Live, upstream: Upstream, response: httpx.Response) -> Outcome:
        status = response.status_code
        content = await response.aread()
        message, param, code = error_message(status, content)
        if status in (429, 503):
            self.pool.pushed_back(upstream, status)
            live.excluded.add(upstream.name)
            return Outcome.RETRY
        if 400 <= status < 500 and status not in (401, 403, 404, 408):
            # Its own validation (context length, a parameter it does not take): the
            # client's request is at fault, and another upstream would say the same.
            raise ClientError(
                APIError(status, f"The upstream refused the request: {message}",
                         param=param, code=code or "upstream_invalid_request")
            )  # fmt: skip
        self.pool.failed(upstream, f"answered {status}: {message[:200]}")
        live.excluded.add(upstream.name)
        return Outcome.RETRY

    async def _stays_paused(self, live: Live) -> bool:
        """Wait while paused; True when it should let go of its upstream instead: a
        request needs its place, or it was paused ``pause_preempt_seconds``."""
        while not live.running.is_set():
            if live.aborted:
                raise asyncio.CancelledError
            limit = self.pause_preempt_seconds
            if limit is not None and time.monotonic() - live.paused_since >= limit:
                live.preempted = True
            if live.preempted:
                return True
            live.wake.clear()
            waiters = {asyncio.ensure_future(live.running.wait()),
                       asyncio.ensure_future(live.wake.wait())}  # fmt: skip
            try:
                await asyncio.wait(waiters, timeout=_PAUSE_CHECK_SECONDS,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                for waiter in waiters:
                    waiter.cancel()
        return False

    async def _keep_pace(self, live: Live, tokens: int) -> None:
        interval = live.request.min_token_interval_seconds
        if interval <= 0.0:
            return
        now = time.monotonic()
        live.next_token_time = max(live.next_token_time, now) + interval * tokens
        if live.next_token_time > now:
            await asyncio.sleep(live.next_token_time - now)

    def _deliver(self, live: Live, delta: Delta) -> int:
        request = live.request
        ids = self.tokenizer.encode(delta.text)
        request.all_token_ids.extend(ids)
        # Its prompt is processed (admission counts what is left of prompts still ahead).
        request.num_computed_tokens = request.num_tokens
        live.text.append(delta.text)
        live.stream.put(
            RequestOutput(
                request.request_id, delta.text, len(ids), request.num_prompt_tokens,
                request.num_output_tokens, committed_token_ids=ids,
            )
        )  # fmt: skip
        return len(ids)

    def _post(
        self,
        live: Live,
        finish: FinishReason,
        *,
        error: str | None = None,
        failure: APIError | None = None,
        reported: tuple[int, int] | None = None,
        cached: int = 0,
    ) -> None:
        request = live.request
        live.stream.put(
            RequestOutput(
                request.request_id, "", 0, request.num_prompt_tokens, request.num_output_tokens,
                finish, error=error or (failure.message if failure else None), failure=failure,
                reported_usage=reported, num_cached_tokens=cached,
            )
        )  # fmt: skip


def _finish_reason(text: str) -> FinishReason:
    return FinishReason.LENGTH if text == "length" else FinishReason.STOP
