"""One request relayed from an upstream: what its client has, and how it is going."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum, auto

from sluicegate.engine.output import RequestStream
from sluicegate.engine.upstream.choices import AnswerState
from sluicegate.engine.upstream.pool import Upstream
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.scheduler.request import Request


class Outcome(Enum):
    FINISHED = auto()
    PREEMPTED = auto()
    RETRY = auto()


class ClientError(Exception):
    """The upstream refused the request itself (its own validation): the client's error."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class Live:
    """One request relayed: what its client has, and how it is going."""

    request: Request
    stream: RequestStream
    call: UpstreamCall
    #: Set while not paused: what a paused relay waits on.  Moved with the request's
    #: pause state, which is the one record of it (:meth:`pause`, :meth:`resume`).
    running: asyncio.Event = field(default_factory=asyncio.Event)
    #: What its client has, choice by choice.
    answer: AnswerState = field(default_factory=AnswerState)
    #: Upstreams that failed this request (not tried again for it).
    excluded: set[str] = field(default_factory=set)
    upstream: str | None = None
    #: The upstream whose place it holds now (None between calls).
    holding: Upstream | None = None
    #: Asked to let go of its upstream (paused, and its place is needed).
    preempted: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: Its client went away: the relay ends at its next line (and its task is cancelled).
    aborted: bool = False
    #: Calls made for it so far, and whether it began with text delivered elsewhere.
    calls: int = 0
    taken_over: bool = False
    #: Its calls that failed (an upstream that died, went silent, pushed back), and why
    #: the last one did: the relay gives up after a few (:meth:`failed`).
    num_failed_calls: int = 0
    last_failure: str | None = None

    def __post_init__(self) -> None:
        if not self.request.pause.paused:
            self.running.set()
        n = self.call.body.get("n")
        self.answer = AnswerState(n if isinstance(n, int) and not isinstance(n, bool) else 1)

    def failed(self, upstream: Upstream, reason: str) -> None:
        """A call on ``upstream`` failed: not tried there again (until it is healthy)."""
        self.excluded.add(upstream.name)
        self.num_failed_calls += 1
        self.last_failure = f"{upstream.name}: {reason}"

    @property
    def paused(self) -> bool:
        return self.request.pause.paused

    def pause(self, now: float) -> bool:
        """Its reader is behind: stop reading its upstream (False if it already was)."""
        if not self.request.pause.begin(now):
            return False
        self.running.clear()
        return True

    def resume(self, now: float) -> float | None:
        """Read on; how long it was paused (None: it was not)."""
        seconds = self.request.pause.end(now)
        self.running.set()
        return seconds

    @property
    def partial_text(self) -> str:
        return self.answer.partial_text

    @property
    def delivered(self) -> bool:
        """Its client has some of its answer."""
        return self.answer.delivered

    @property
    def affinity_key(self) -> str | None:
        if self.call.kind == "chat":
            messages = self.call.body.get("messages") or []
            first = messages[0] if messages else None
            return repr(first.get("content")) if isinstance(first, dict) else None
        prompt = self.call.body.get("prompt")
        return prompt[:256] if isinstance(prompt, str) else None
