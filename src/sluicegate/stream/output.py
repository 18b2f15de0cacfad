"""What the engine side hands to one request's stream, and the stream itself.

The engine thread produces :class:`RequestOutput` deltas; the event loop receives them
in one batch per step and appends them to each request's :class:`RequestStream`, which
the HTTP writer drains.  Deltas waiting in a stream are merged when the writer reads, so
a slow writer reads fewer, larger deltas instead of queueing one object per token.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class StreamTimings:
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None


class RequestStream:
    """The event-loop side of one request's output.  Single consumer."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()
        self.finished = False
        self.timings = StreamTimings()

    def put(self, output: RequestOutput) -> None:
        if self.finished:
            return
        if self.timings.first_token_time is None and output.num_new_tokens:
            self.timings.first_token_time = time.monotonic()
        if output.finished:
            self.finished = True
            self.timings.finish_time = time.monotonic()
        self._pending.append(output)
        self._ready.set()

    @property
    def num_buffered_tokens(self) -> int:
        return sum(o.num_new_tokens for o in self._pending)

    async def get(self) -> RequestOutput:
        """Wait for output; return everything pending merged into one delta."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        first = self._pending.popleft()
        while self._pending:
            nxt = self._pending.popleft()
            first = RequestOutput(
                request_id=first.request_id,
                text=first.text + nxt.text,
                num_new_tokens=first.num_new_tokens + nxt.num_new_tokens,
                num_prompt_tokens=nxt.num_prompt_tokens,
                num_output_tokens=nxt.num_output_tokens,
                finish_reason=nxt.finish_reason,
                error=nxt.error,
            )
        return first
