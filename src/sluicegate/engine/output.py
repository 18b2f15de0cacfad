"""What the engine side hands to one request's stream, and the stream itself.

The engine thread produces :class:`RequestOutput` deltas; the event loop receives them
in one batch per step and appends them to each request's :class:`RequestStream`.  The
writer takes them out according to the flush policy: the first token at once (TTFT
never waits for a chunk), then coalesced every ``flush_interval`` or
``flush_max_tokens``, whichever comes first.  Deltas waiting in a stream are merged, so
a slow writer reads fewer, larger deltas instead of one object per token.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluicegate.errors import APIError
from sluicegate.scheduler.request import FinishReason


@dataclass(slots=True)
class RequestOutput:
    """A delta for one request."""

    request_id: str
    text: str
    num_new_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    #: Output tokens whose text is complete with this delta's text (see
    #: :class:`~sluicegate.engine.detokenizer.TextAssembler`): the text of every delta so far is
    #: exactly the text of every committed token so far.
    committed_token_ids: list[int] = field(default_factory=list)
    #: With an ``error``: what its client is told, when not an engine failure (an
    #: upstream's own refusal of the request, or no upstream able to serve it).
    failure: APIError | None = None
    #: (prompt, completion) tokens as the engine that answered counts them, when it is
    #: not ours (an upstream's ``usage``): what the client's ``usage`` reports.
    reported_usage: tuple[int, int] | None = None
    #: Prompt tokens reused from the prefix cache (OpenAI's ``cached_tokens``).
    num_cached_tokens: int = 0
    #: The choice it belongs to (``n`` > 1); every other field is that choice's.
    index: int = 0
    #: Tool-call fragments in OpenAI's streamed shape (``delta.tool_calls`` entries: index,
    #: and on a call's first fragment id, type and ``function.name``; then
    #: ``function.arguments`` pieces).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    #: Log probabilities of its tokens in OpenAI's chat shape (``logprobs.content``
    #: entries: token, logprob, bytes, top_logprobs).
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    #: A refusal's text (an upstream's ``delta.refusal``).
    refusal: str = ""
    #: This choice ended, as OpenAI names it (``n`` > 1 or an upstream's own reason); the
    #: stream itself ends with ``finish_reason``.
    choice_finish: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_content(self) -> bool:
        """Whether it carries anything a client is sent (text or another part)."""
        return bool(self.text or self.tool_calls or self.logprobs or self.refusal)


@dataclass(slots=True)
class StreamTimings:
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass(slots=True, frozen=True)
class FlushPolicy:
    """When the writer takes tokens out: first at once, then by time or by count."""

    interval_seconds: float = 0.040
    max_tokens: int = 24
    heartbeat_seconds: float = 15.0


class RequestStream:
    """The event-loop side of one request's output.  One consumer (the writer)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.timings = StreamTimings()
        #: Tokens put but not yet taken by the writer, and their text's UTF-8 size.
        self.pending_tokens = 0
        self.pending_bytes = 0
        self.total_tokens = 0
        self._first_taken = False
        self._last_take_time = 0.0
        #: Called after every put (flow control checks the water marks there).
        self.on_put: Callable[[RequestStream], None] | None = None
        #: Set whenever output is taken (a pipeline stage waits on it for room).
        self._taken = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        if self.timings.first_token_time is None and output.num_new_tokens:
            self.timings.first_token_time = time.monotonic()
        if output.finished:
            self.finished = True
            self.timings.finish_time = time.monotonic()
        self._pending.append(output)
        self.pending_tokens += output.num_new_tokens
        self.pending_bytes += len(output.text.encode())
        self.total_tokens += output.num_new_tokens
        self._ready.set()
        if self.on_put is not None:
            self.on_put(self)

    async def get(self) -> RequestOutput:
        """Wait for output; return everything pending merged into one delta."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    async def next(self, policy: FlushPolicy) -> RequestOutput | None:
        """The next flush by ``policy``; None when a heartbeat is due instead.

        With a zero interval every delta is its own flush, even when several wait (the
        caller decides how far ahead of its reader it may run).
        """
        loop = asyncio.get_running_loop()
        if not self._pending:
            self._ready.clear()
            try:
                async with asyncio.timeout(policy.heartbeat_seconds):
                    await self._ready.wait()
            except TimeoutError:
                return None
        if policy.interval_seconds <= 0:
            self._first_taken = True
            return self._take_one()
        if self._first_taken and policy.interval_seconds > 0:
            deadline = self._last_take_time + policy.interval_seconds
            while (
                not self.finished
                and self.pending_tokens < policy.max_tokens
                and (remaining := deadline - loop.time()) > 0
            ):
                self._ready.clear()
                try:
                    async with asyncio.timeout(remaining):
                        await self._ready.wait()
                except TimeoutError:
                    break
        self._first_taken = True
        self._last_take_time = loop.time()
        return self._take()

    def take(self, max_tokens: int) -> RequestOutput | None:
        """Take pending output carrying at most ``max_tokens`` tokens (credit-based sends).

        Outputs without tokens (the final one) come along; ``None`` if nothing fits.
        """
        taken: list[RequestOutput] = []
        budget = max_tokens
        while (
            self._pending
            and self._pending[0].num_new_tokens <= budget
            and (not taken or self._pending[0].index == taken[0].index)
        ):
            out = self._take_one()
            budget -= out.num_new_tokens
            taken.append(out)
        return _merge(taken) if taken else None

    async def get_one(self) -> RequestOutput:
        """Wait for output; return the oldest delta alone (a pipeline stage's input)."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._take_one()

    async def wait_room(self, capacity_tokens: int) -> None:
        """Wait until fewer than ``capacity_tokens`` tokens are pending (a bounded channel)."""
        while self.pending_tokens >= capacity_tokens and not self.finished:
            self._taken.clear()
            await self._taken.wait()

    async def wait(self) -> None:
        """Wait until something is pending."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()

    def _take_one(self) -> RequestOutput:
        output = self._pending.popleft()
        self.pending_tokens -= output.num_new_tokens
        self.pending_bytes -= len(output.text.encode())
        self._taken.set()
        return output

    def _take(self) -> RequestOutput:
        """Everything pending of the first pending output's choice, up to another
        choice's output (one choice per delta), merged."""
        index = self._pending[0].index
        run = [self._take_one()]
        while self._pending and self._pending[0].index == index:
            run.append(self._take_one())
        if self._pending:
            self._ready.set()
        return _merge(run)


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request's choice as one new delta (the last one's totals
    and finish)."""
    last = outputs[-1]
    tool_calls: list[dict[str, Any]] = []
    for output in outputs:
        for fragment in output.tool_calls:
            merge_tool_call(tool_calls, fragment)
    return RequestOutput(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        num_new_tokens=sum(o.num_new_tokens for o in outputs),
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        finish_reason=last.finish_reason,
        error=last.error,
        failure=last.failure,
        reported_usage=last.reported_usage,
        committed_token_ids=[t for o in outputs for t in o.committed_token_ids],
        num_cached_tokens=last.num_cached_tokens,
        index=last.index,
        tool_calls=tool_calls,
        logprobs=[entry for o in outputs for entry in o.logprobs],
        refusal="".join(o.refusal for o in outputs),
        choice_finish=next((o.choice_finish for o in reversed(outputs) if o.choice_finish), None),
    )


def merge_tool_call(calls: list[dict[str, Any]], fragment: dict[str, Any]) -> None:
    """Add a streamed tool-call fragment to ``calls`` (fragments as OpenAI streams them,
    or whole calls): a fragment of the call last seen at its index extends that call's
    arguments; one with a new index (or a new id) starts a call."""
    index = fragment.get("index", len(calls))
    function = fragment.get("function") or {}
    last = calls[-1] if calls else None
    if (
        last is not None
        and last.get("index") == index
        and (not fragment.get("id") or fragment.get("id") == last.get("id"))
    ):
        into = last.setdefault("function", {})
        if function.get("name") and not into.get("name"):
            into["name"] = function["name"]
        into["arguments"] = into.get("arguments", "") + (function.get("arguments") or "")
        return
    # Only what the fragment carries: a call's later fragments stream as OpenAI's do,
    # with its index and a piece of its arguments (whole answers fill in the rest).
    call: dict[str, Any] = {"index": index}
    if fragment.get("id"):
        call["id"] = fragment["id"]
    if fragment.get("type"):
        call["type"] = fragment["type"]
    parts: dict[str, Any] = {}
    if function.get("name"):
        parts["name"] = function["name"]
    parts["arguments"] = function.get("arguments") or ""
    call["function"] = parts
    calls.append(call)


@dataclass(slots=True)
class Choice:
    """One choice of a whole (non-streamed) answer, assembled from its deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    finish: str | None = None


class Answer:
    """A whole answer's choices, from every delta of its stream (any order of choices)."""

    def __init__(self) -> None:
        self._choices: dict[int, Choice] = {}

    def add(self, output: RequestOutput) -> None:
        choice = self._choices.get(output.index)
        if choice is None:
            choice = self._choices[output.index] = Choice(output.index)
        choice.text.append(output.text)
        for fragment in output.tool_calls:
            merge_tool_call(choice.tool_calls, fragment)
        choice.logprobs.extend(output.logprobs)
        if output.refusal:
            choice.refusal.append(output.refusal)
        if output.choice_finish:
            choice.finish = output.choice_finish

    def choices(self) -> list[Choice]:
        """Every choice, by index (choice 0 always, even when nothing came)."""
        if 0 not in self._choices:
            self._choices[0] = Choice(0)
        return [self._choices[i] for i in sorted(self._choices)]


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    return outputs[0] if len(outputs) == 1 else merge_outputs(outputs)
