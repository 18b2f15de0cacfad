"""Output stages: async transformers of a request's deltas.

A stage's ``process`` takes one delta and returns what it passes on (none while it holds
text back, several if it splits).  The final delta it returns ends the request's output.

* :class:`GuardStage` runs its checks on a sliding window of the output: every
  ``stride_tokens`` tokens, the window is the last ``window_tokens`` tokens (what was
  released before, as context, plus what it holds).  It releases what it holds only once
  a check of a window containing it passed, and even then keeps back the last deltas
  that hold its checks' longest match less one character (a regex's own bound, or the
  check's ``max_match_chars``): a match is seen whole before any of it is sent, however
  it straddles windows, so the client sees a token at most a stride and that many
  characters later than without the guard, and nothing of a match.  A trip aborts the
  sequence at once and ends the output with the replacement text and
  ``finish_reason: "content_filter"``.
* :class:`FormatStage` puts a prefix before the answer and a suffix (and the sources the
  answer was retrieved from) after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from sluicegate.engine.output import RequestOutput, merge_outputs
from sluicegate.pipeline.checks import Check, Trip, first_trip
from sluicegate.pipeline_settings import FormatSettings, GuardSettings
from sluicegate.scheduler.request import FinishReason

#: Finish reasons whose output is the answer's natural end (checked and formatted);
#: the others (abort, error) end it without more text.
NATURAL_ENDS = (FinishReason.STOP, FinishReason.LENGTH)


class Stage(Protocol):
    name: str

    async def process(self, delta: RequestOutput) -> list[RequestOutput]: ...


def final_like(delta: RequestOutput, text: str, reason: FinishReason) -> RequestOutput:
    """A final delta carrying ``text`` instead of what the engine produced."""
    return RequestOutput(
        delta.request_id,
        text,
        0,
        delta.num_prompt_tokens,
        delta.num_output_tokens,
        reason,
        reported_usage=delta.reported_usage,
        num_cached_tokens=delta.num_cached_tokens,
    )


class GuardStage:
    def __init__(
        self,
        settings: GuardSettings,
        checks: list[Check],
        on_trip: Callable[[Trip], None],
        on_check: Callable[[float], None] | None = None,
    ) -> None:
        self.name = settings.name
        self.settings = settings
        self.checks = checks
        self.on_trip = on_trip
        self.on_check = on_check
        self.held: list[RequestOutput] = []
        self.held_tokens = 0
        #: Released (text, tokens), the last ``window - stride`` tokens: the context.
        self.context: deque[tuple[str, int]] = deque()
        self.context_tokens = 0
        self.trip: Trip | None = None
        #: Windows checked (for tests and stats).
        self.windows = 0
        #: Characters held back after a window passes (its checks' longest match less
        #: one): a match is then never sent in part before it is seen whole.
        self.hold_chars = max((c.max_match_chars or 1 for c in checks), default=1) - 1

    async def process(self, delta: RequestOutput) -> list[RequestOutput]:
        if self.trip is not None:
            return []
        if delta.finished and delta.finish_reason not in NATURAL_ENDS:
            # Stopped or failed: what is held was never checked, so it is not sent (a
            # resumed stream regenerates it: it was not logged).
            self.held, self.held_tokens = [], 0
            return [
                final_like(delta, "", delta.finish_reason or FinishReason.ABORT)
                if delta.error is None and delta.failure is None
                else delta
            ]
        self.held.append(delta)
        self.held_tokens += delta.num_new_tokens
        if self.held_tokens < self.settings.stride_tokens and not delta.finished:
            return []
        window = "".join(t for t, _ in self.context) + "".join(d.text for d in self.held)
        self.windows += 1
        trip = await first_trip(self.checks, window, self.settings.check_timeout_seconds)
        if trip is not None:
            self.trip = trip
            self.on_trip(trip)
            return [final_like(delta, self.settings.replacement, FinishReason.CONTENT_FILTER)]
        # What a match still being written could begin with stays held: the shortest
        # tail of deltas that holds at least its longest match less one character.
        keep = len(self.held)
        if not delta.finished:
            tail = 0
            while keep > 0 and tail < self.hold_chars:
                keep -= 1
                tail += len(self.held[keep].text)
        out, self.held, self.held_tokens = self.held[:keep], self.held[keep:], 0
        if not out:
            return []
        released = merge_outputs(out)
        self._remember(released.text, released.num_new_tokens)
        return [released]

    def _remember(self, text: str, tokens: int) -> None:
        keep = self.settings.window_tokens - self.settings.stride_tokens
        self.context.append((text, tokens))
        self.context_tokens += tokens
        while self.context and self.context_tokens - self.context[0][1] >= keep:
            self.context_tokens -= self.context.popleft()[1]
        if keep == 0:
            self.context.clear()
            self.context_tokens = 0


class FormatStage:
    def __init__(self, settings: FormatSettings, sources: list[str], resumed: bool) -> None:
        self.name = settings.name
        self.settings = settings
        self.sources = sources
        #: The prefix was sent (before a takeover, by the replica that started the stream).
        self.started = resumed

    async def process(self, delta: RequestOutput) -> list[RequestOutput]:
        text = delta.text
        if not self.started and (text or delta.finished):
            self.started = True
            text = self.settings.prefix + text
        if delta.finished and delta.finish_reason in NATURAL_ENDS:
            text += self.settings.suffix
            if self.settings.citations and self.sources:
                text += "\n\nSources: " + ", ".join(self.sources)
        if text is delta.text:
            return [delta]
        out = merge_outputs([delta])
        out.text = text
        return [out]
