"""Pace-aware scheduling (``scheduling: qoe``): serve for how people read
(docs/pace-aware-scheduling.md).

People read at a few tokens a second; the engine makes tens a second per stream.  After
Andes (arXiv 2404.16283), a stream's quality of experience compares the tokens delivered
with the tokens a reader at the expected pace needs: token ``i`` of an answer is needed
``i / pace`` seconds after the first.  Under ``qoe``:

- **The batch is sized for readers.**  The seat limit keeps the decode step within the
  reading pace's interval rather than the TPOT objective, when that is looser
  (:func:`seat_objective_seconds`): a reader gains nothing from tokens faster than it
  reads, and a larger batch starts more answers.  This is where the capacity comes from.
- **A reader's clock.**  Each decoding sequence's *lead* is how long its reader can go on
  reading what it already has.  The pace is the one its client shows (flow control
  measures how fast a client with a backlog takes tokens in), else the one declared for
  its tenant, else ``reading_tokens_per_second``; never faster than its own
  ``max_tokens_per_second``.
- **Yielding to readers who are behind.**  In a step where a reader waits (a decoding
  sequence whose lead is gone, a preempted one re-prefilling what its reader has not
  yet read, or work in the scheduler's waiting line), every sequence more than
  ``lead_seconds`` ahead of its reader sits the step out, and keeps sitting out until a
  third of that lead is left: the step is smaller, so faster for those who need it.  A
  yielding sequence keeps its seat and its KV: it is still an admitted reader, only not
  in a hurry (lending its seat would admit more readers than the engine feeds).
- **Nothing yields otherwise**, not even for a new prompt: a sequence running ahead
  finishes sooner and frees its seat sooner, and its text waits in its stream's buffer
  at no cost to anyone.  Measured: yielding for every prefill held seats twice as long
  and admitted fewer answers (docs/pace-aware-scheduling.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.scheduler.request import Request


@dataclass(frozen=True, slots=True)
class PacingConfig:
    enabled: bool = False
    #: The pace a reader is expected to read at (tokens per second) when its stream has
    #: shown none and its tenant declares none.
    reading_tokens_per_second: float = 8.0
    #: How far ahead of its reader a sequence may get while someone needs speed.
    lead_seconds: float = 3.0


def seat_objective_seconds(tpot_objective: float | None, config: PacingConfig) -> float | None:
    """The time per output token the seat limit keeps the batch under: the TPOT
    objective, or under ``qoe`` the reading pace's interval when that is looser (a reader
    gains nothing from tokens faster than it reads; a larger batch starts more answers)."""
    if not config.enabled or tpot_objective is None:
        return tpot_objective
    return max(tpot_objective, 1.0 / config.reading_tokens_per_second)


class ReaderPacing:
    """Where each decoding sequence stands against its reader, and who yields a step."""

    def __init__(self, config: PacingConfig) -> None:
        self.config = config
        #: Times a sequence started sitting out for its reader.
        self.num_yields = 0
        #: Sequence-steps sat out.
        self.num_yielded_steps = 0

    def pace(self, request: Request) -> float:
        """Its reader's pace: measured from its client, else declared, else the default;
        never faster than its own cap."""
        pace = (
            request.pace.measured_tokens_per_second
            or request.pace.reading_tokens_per_second
            or self.config.reading_tokens_per_second
        )
        if request.pace.capped:
            pace = min(pace, 1.0 / request.pace.min_token_interval_seconds)
        return pace

    def note_token(self, request: Request, now: float) -> None:
        """A token was appended: the first one here starts its reader's clock (a resumed
        stream's starts as if the tokens it brought had been read at pace)."""
        if request.pace.first_output_time is None:
            request.pace.first_output_time = now - (request.num_output_tokens - 1) / self.pace(
                request
            )

    def lead(self, request: Request, now: float) -> float:
        """Seconds until its reader needs a token it does not have (negative: behind)."""
        assert request.pace.first_output_time is not None
        return request.pace.first_output_time + request.num_output_tokens / self.pace(request) - now

    def plan(self, running: list[Request], num_waiting: int, now: float) -> None:
        """Before a step: set ``yielding`` on each running sequence.  Only sequences that
        decode (they have output, and their reader's clock runs) may yield, and only while
        someone needs speed."""
        if not self.config.enabled:
            return
        high = self.config.lead_seconds
        low = high / 3.0
        needs_speed = num_waiting > 0
        ahead: list[tuple[Request, bool]] = []
        for request in running:
            was_yielding, request.pace.yielding = request.pace.yielding, False
            if (
                request.pause.paused
                or request.pace.throttled
                or request.pace.first_output_time is None
            ):
                continue  # idle, or a new prompt whose reader's clock has not started
            lead = self.lead(request, now)
            if request.num_computed_tokens + 1 < request.num_tokens:
                needs_speed = needs_speed or lead < high  # a re-prefill its reader awaits
            elif lead < 0.0:
                needs_speed = True  # its reader is waiting for a token
            elif lead > high or (was_yielding and lead > low):
                ahead.append((request, was_yielding))
        if not needs_speed:
            return
        for request, was_yielding in ahead:
            request.pace.yielding = True
            self.num_yields += not was_yielding
            self.num_yielded_steps += 1

    def snapshot(self) -> dict[str, float | int]:
        return {
            "reading_tokens_per_second": self.config.reading_tokens_per_second,
            "lead_seconds": self.config.lead_seconds,
            "yields": self.num_yields,
            "yielded_sequence_steps": self.num_yielded_steps,
        }
