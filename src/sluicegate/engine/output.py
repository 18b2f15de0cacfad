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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        while self._pending and self._pending[0].num_new_tokens <= budget:
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
        merged = _merge(list(self._pending))
        self._pending.clear()
        self.pending_tokens = 0
        self.pending_bytes = 0
        self._taken.set()
        return merged


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one new delta (the last one's totals and finish)."""
    last = outputs[-1]
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
    )


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    return outputs[0] if len(outputs) == 1 else merge_outputs(outputs)
