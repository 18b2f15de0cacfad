"""One call to one upstream: send the request (its continuation, or the request again
from the start), relay its streamed answer into the request's stream choice by choice
(text, whole tool calls, refusals, log probabilities, each choice's finish: see
:mod:`~sluicegate.engine.upstream.choices`), and say how it ended (:class:`Outcome`).

While its reader is behind, the relay stops reading the upstream's answer (the socket
fills and TCP holds the upstream back); a request that must let go of its place ends the
call as ``PREEMPTED`` and is continued later.  Deltas are paced by
:meth:`~sluicegate.scheduler.request.Pace.after_tokens`, the embedded scheduler's rule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from sluicegate.config import Settings
from sluicegate.engine.output import RequestOutput
from sluicegate.engine.tokenizer import ChatTemplateError, TextTokenizer
from sluicegate.engine.upstream.choices import Diverged, Piece
from sluicegate.engine.upstream.live import ClientError, Live, Outcome
from sluicegate.engine.upstream.pool import Upstream, UpstreamPool
from sluicegate.engine.upstream.signals import Prefill
from sluicegate.engine.upstream.wire import (
    ChoiceDelta,
    EventTooLarge,
    bounded_lines,
    error_message,
    parse_event,
)
from sluicegate.engine.upstream.wire import request_body as build_body
from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason

logger = logging.getLogger(__name__)

#: How often a paused request checks whether it should let go of its upstream.
PAUSE_CHECK_SECONDS = 0.25


class Relay:
    """Makes the calls of every request relayed (the upstream core's, event loop)."""

    def __init__(
        self,
        pool: UpstreamPool,
        tokenizer: TextTokenizer,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.settings = settings
        #: Pacing's clock and sleep (a test's fake clock can stand in for both).
        self._clock = clock
        self._sleep = sleep
        self.num_calls = 0
        self.preemptions = 0
        #: A paused request lets go of its upstream after this long (None: only when a
        #: request needs its place).
        self.pause_preempt_seconds = settings.pause_preempt_seconds
        #: Means of the requests answered, for admission's estimate.
        self.mean_prompt = 128.0
        self.mean_output = 64.0

    async def call(self, live: Live, upstream: Upstream) -> Outcome:
        request = live.request
        call = live.call
        answer = live.answer
        # Restart-and-skip (see choices.py) where appending text cannot continue it, or
        # where a completion of the rendered conversation would lose its tools.
        restart = (
            answer.needs_restart
            or not answer.delivered
            or (upstream.continue_style == "completion" and _structured(live))
        )
        if live.taken_over and live.calls == 0 and _structured(live):
            raise ClientError(_not_continued_here())
        tokens_left = call.max_tokens - request.num_output_tokens
        if not restart and tokens_left <= 0:
            post(live, FinishReason.LENGTH)
            return Outcome.FINISHED
        continuing_chat = call.kind == "chat" and not restart
        path, body = build_body(
            call,
            upstream.upstream_model(call.model),
            "" if restart else live.partial_text,
            call.max_tokens if restart else tokens_left,
            upstream.continue_style,
            self._render,
        )
        answer.begin_call(restart)
        self.num_calls += 1
        live.calls += 1
        settings = self.settings
        # Until its headers, the first-token timeout (an upstream that hangs before
        # answering at all); the body's reads are timed as they come.
        until_headers = httpx.Timeout(
            settings.upstream_first_token_timeout_seconds,
            connect=settings.upstream_connect_timeout_seconds,
        )
        prefill = upstream.prefill.begin(request.num_prompt_tokens)
        try:
            async with upstream.client.stream(
                "POST", path, json=body, timeout=until_headers
            ) as response:
                if response.status_code != 200:
                    if continuing_chat and self._refuses_continuation(upstream, response):
                        return Outcome.RETRY  # at once, as a completion, on the same one
                    return await self._refused(live, upstream, response)
                budget = call.max_tokens if restart else tokens_left
                return await self._relay(live, upstream, response, budget, prefill)
        except httpx.HTTPError as exc:
            return self._failed(live, upstream, repr(exc))
        except EventTooLarge as exc:
            _protocol_error(upstream, "event_too_large")
            return self._failed(live, upstream, f"it sent {exc}")
        finally:
            prefill.done()

    async def _relay(
        self,
        live: Live,
        upstream: Upstream,
        response: httpx.Response,
        budget: int,
        prefill: Prefill,
    ) -> Outcome:
        """Read the answer's events into the request's stream, no more than ``budget``
        tokens a choice: an upstream that goes on past it (it ignores ``max_tokens``) is
        cut there, the answer ending with ``length`` (:class:`Overrun`)."""
        settings = self.settings
        request = live.request
        lines = bounded_lines(response.aiter_bytes(), settings.upstream_max_event_bytes)
        overrun = Overrun(budget)
        finish: FinishReason | None = None
        reported: tuple[int, int] | None = None
        cached = 0
        started = time.monotonic()
        first_time: float | None = None
        last_time = started
        tokens = 0
        done = False
        # Silence is timed from the upstream's last progress on the answer (or the call's
        # start, or the end of a pause or a pacing wait), not from its last line: SSE
        # comments (another Sluicegate's queue position, heartbeats) and empty deltas are
        # no answer, and an upstream that sends only them must not hold the stream forever.
        heard = started
        while True:
            if live.aborted:
                raise asyncio.CancelledError
            if live.paused:
                if await self._stays_paused(live):
                    upstream.aborts_total += 1
                    self.preemptions += 1
                    return Outcome.PREEMPTED
                heard = time.monotonic()  # its reader was behind, not the upstream
            timeout = (
                settings.upstream_first_token_timeout_seconds
                if first_time is None
                else settings.upstream_idle_timeout_seconds
            )
            try:
                # Not asyncio.wait_for: on 3.11 it can swallow a cancellation.
                async with asyncio.timeout(max(0.0, heard + timeout - time.monotonic())):
                    line = await anext(lines)
            except StopAsyncIteration:
                break
            except TimeoutError:
                return self._failed(live, upstream, f"silent for {timeout:g} s")
            if not line.startswith("data:"):
                continue
            delta = parse_event(line[5:].encode())
            if delta is None:
                continue
            if delta.error is not None:
                return self._failed(live, upstream, f"error event: {delta.error}")
            if delta.done:
                done = True
                break
            if overrun.past(delta.choices):
                _protocol_error(upstream, "max_tokens")
                logger.warning(
                    "upstream %s went past max_tokens (%d) or its bytes: cut", upstream.name, budget
                )
                finish, done = FinishReason.LENGTH, True
                break
            for choice in delta.choices:
                if choice.progress:
                    heard = now = time.monotonic()
                    if choice.has_content:
                        if first_time is None:
                            first_time = now
                            prefill.done()
                        last_time = now
                num_tokens = self._deliver(live, _absorb(live, choice))
                tokens += num_tokens
                if choice.finish_reason is not None and choice.index == 0:
                    finish = _finish_reason(choice.finish_reason)
                if num_tokens:
                    wait = request.pace.after_tokens(self._clock(), num_tokens)
                    if wait > 0.0:
                        await self._sleep(wait)
                        heard = time.monotonic()  # its own pace, not the upstream's
            if delta.prompt_tokens is not None and delta.completion_tokens is not None:
                reported = (delta.prompt_tokens, delta.completion_tokens)
                cached = delta.cached_tokens
        if finish is None or not (done or live.answer.whole):
            # The stream ended without saying how (or with choices unfinished and no
            # ``[DONE]``): the upstream died mid-answer.
            return self._failed(live, upstream, "its stream ended without a finish reason")
        for piece in _end(live):
            self._deliver(live, piece)
        self.mean_prompt += 0.05 * (request.num_prompt_tokens - self.mean_prompt)
        self.mean_output += 0.05 * (max(1, request.num_output_tokens) - self.mean_output)
        # Its TTFT from its sending, against the prompts prefilled with it: those it found
        # there, and those sent after it (an upstream that prefills together) or not.
        ahead, later = prefill.group or (prefill.prompt_tokens, 0)
        upstream.latency.observe(
            ahead + (later if self.settings.upstream_prefill == "together" else 0),
            None if first_time is None or live.preempted else first_time - prefill.sent_at,
            (last_time - first_time) / (tokens - 1) if first_time and tokens > 1 else None,
        )
        self.pool.succeeded(upstream)
        # The upstream's own usage, when the whole answer came from this one call.
        if live.calls == 1 and not live.taken_over:
            post(live, finish, reported=reported, cached=cached)
        else:
            post(live, finish)
        return Outcome.FINISHED

    def _failed(self, live: Live, upstream: Upstream, reason: str) -> Outcome:
        self.pool.failed(upstream, reason)
        live.failed(upstream, reason)
        return Outcome.RETRY

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
        logger.info(
            "upstream %s refused a chat continuation (%d): continuing chats on "
            "/v1/completions from now on",
            upstream.name,
            status,
        )
        return True

    async def _refused(self, live: Live, upstream: Upstream, response: httpx.Response) -> Outcome:
        status = response.status_code
        content = await response.aread()
        message, param, code = error_message(status, content)
        if status in (429, 503):
            self.pool.pushed_back(upstream, status)
            live.failed(upstream, f"answered {status}")
            return Outcome.RETRY
        if 400 <= status < 500 and status not in (401, 403, 404, 408):
            # Its own validation (context length, a parameter it does not take): the
            # client's request is at fault, and another upstream would say the same.
            error = APIError(
                status,
                f"The upstream refused the request: {message}",
                param=param,
                code=code or "upstream_invalid_request",
            )
            raise ClientError(error)
        return self._failed(live, upstream, f"answered {status}: {message[:200]}")

    async def _stays_paused(self, live: Live) -> bool:
        """Wait while paused; True when it should let go of its upstream instead: a
        request needs its place, or it was paused ``pause_preempt_seconds``."""
        while live.paused:
            if live.aborted:
                raise asyncio.CancelledError
            limit = self.pause_preempt_seconds
            if limit is not None and time.monotonic() - live.request.pause.since >= limit:
                live.preempted = True
            if live.preempted:
                return True
            live.wake.clear()
            waiters = {
                asyncio.ensure_future(live.running.wait()),
                asyncio.ensure_future(live.wake.wait()),
            }
            try:
                await asyncio.wait(
                    waiters, timeout=PAUSE_CHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
        return False

    def _deliver(self, live: Live, piece: Piece) -> int:
        """Put what goes out of one choice into the request's stream; its tokens (text,
        refusal and calls, counted with the gateway's tokenizer, for limits and pacing)."""
        answer = live.answer
        # One choice's end of several, or a reason the stream's own finish lacks.
        choice_finish = piece.finish
        if choice_finish is not None and not answer.multiple and choice_finish in _FINISHES:
            choice_finish = None  # the stream's finish says it
        if not (piece.text or piece.tool_calls or piece.refusal or piece.logprobs or choice_finish):
            return 0
        request = live.request
        encode = self.tokenizer.encode
        ids = encode(piece.text) if piece.text else []
        others = [encode(piece.refusal)] if piece.refusal else []
        for fragment in piece.tool_calls:
            function = fragment["function"]
            others.append(encode(function["name"] + function["arguments"]))
        extra = [t for more in others for t in more]
        request.all_token_ids.extend(ids)
        request.all_token_ids.extend(extra)
        # Its prompt is processed (admission counts what is left of prompts still ahead).
        request.num_computed_tokens = request.num_tokens
        output = RequestOutput(
            request.request_id,
            piece.text,
            len(ids) + len(extra),
            request.num_prompt_tokens,
            request.num_output_tokens,
            # What a takeover continues from (one choice's text; with calls or several
            # choices their tokens only say that it has begun, see _structured).
            committed_token_ids=ids + extra,
            index=piece.index,
            tool_calls=piece.tool_calls,
            logprobs=piece.logprobs,
            refusal=piece.refusal,
            choice_finish=choice_finish,
        )
        live.stream.put(output)
        return output.num_new_tokens


def post(
    live: Live,
    finish: FinishReason,
    *,
    error: str | None = None,
    failure: APIError | None = None,
    reported: tuple[int, int] | None = None,
    cached: int = 0,
) -> None:
    """The request's final output."""
    request = live.request
    output = RequestOutput(
        request.request_id,
        "",
        0,
        request.num_prompt_tokens,
        request.num_output_tokens,
        finish,
        error=error or (failure.message if failure else None),
        failure=failure,
        reported_usage=reported,
        num_cached_tokens=cached,
    )
    live.stream.put(output)


#: The upstream's finish reasons a stream's own finish carries (others go out as the
#: choice's finish, the stream's being ``stop``).
_FINISHES = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "content_filter": FinishReason.CONTENT_FILTER,
}


def _finish_reason(text: str) -> FinishReason:
    return _FINISHES.get(text, FinishReason.STOP)


class Overrun:
    """Whether an upstream's answer has gone past its call's ``max_tokens``: an honest
    upstream sends at most one event with progress per token (vLLM, SGLang, TGI,
    llama.cpp send one or fewer) plus one that only finishes, and at most a few hundred
    bytes of text a token.  The gateway cannot count the upstream's tokens itself (its
    tokenizer may be another, or count bytes), so it bounds what it can see: events with
    progress, and bytes of text, per choice."""

    #: Bytes of text (content, refusal, call names and arguments) a token may carry.
    BYTES_PER_TOKEN = 128
    SLACK_BYTES = 64 * 1024

    def __init__(self, budget: int) -> None:
        self.budget = max(1, budget)
        self.events: dict[int, int] = {}
        self.bytes: dict[int, int] = {}

    def past(self, choices: list[ChoiceDelta]) -> bool:
        """Count an event's choices; True once one is past its bound."""
        most_bytes = self.BYTES_PER_TOKEN * self.budget + self.SLACK_BYTES
        over = False
        for choice in choices:
            index = choice.index
            events = self.events[index] = self.events.get(index, 0) + choice.progress
            size = self.bytes[index] = self.bytes.get(index, 0) + choice.text_size
            over = over or events > self.budget + 1 or size > most_bytes
        return over


def _protocol_error(upstream: Upstream, reason: str) -> None:
    upstream.protocol_errors[reason] = upstream.protocol_errors.get(reason, 0) + 1


def _absorb(live: Live, choice: ChoiceDelta) -> Piece:
    try:
        return live.answer.absorb(choice)
    except Diverged as exc:
        raise ClientError(_diverged(exc)) from None


def _end(live: Live) -> list[Piece]:
    try:
        return live.answer.end_call()
    except Diverged as exc:
        raise ClientError(_diverged(exc)) from None


def _diverged(exc: Diverged) -> APIError:
    return APIError(
        502,
        "The upstream failed mid-answer, and the answer asked again of another upstream "
        f"differs from what this stream already sent ({exc}): the stream ends here rather "
        "than send parts twice or broken. Send the request again.",
        code="upstream_answer_diverged",
    )


def _structured(live: Live) -> bool:
    """It may have tool calls or several choices (which a takeover cannot know of)."""
    body = live.call.body
    return live.answer.multiple or bool(body.get("tools") or body.get("functions"))


def _not_continued_here() -> APIError:
    return APIError(
        502,
        "This stream was taken over from a replica that stopped mid-answer; an answer "
        "that may hold tool calls or several choices cannot be continued on another "
        "replica without repeating or breaking them. Send the request again.",
        code="upstream_answer_not_resumable",
    )
