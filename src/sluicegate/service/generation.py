"""One accepted request's life: its sequence, its output channel and its delivery timings."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field

from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.pipeline.chain import StageChain
from sluicegate.queue.ticket import Ticket
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from sluicegate.service.choices import Choices
from sluicegate.service.ownership import RESUME_TOKEN_HEADER, Owner


class Life(enum.IntEnum):
    """Where a request is in its life.  Ordered: everything from ``COMPLETED`` on is an end.

    Whether a live request waits in the queue or runs on the engine is its ticket's to say
    (:attr:`Generation.queued`).
    """

    #: Admitted: queued or running.
    LIVE = enum.auto()
    #: Ran to its end: a stop, the length limit, or an engine error.
    COMPLETED = enum.auto()
    #: The client went away, cancelled, was evicted, or the stream could not be logged.
    CANCELLED = enum.auto()
    #: Stopped before its end, to be continued (drain, detach grace, lease lost): a
    #: resumable stream continues on any replica; a plain request is told to retry.
    STOPPED = enum.auto()

    @property
    def ended(self) -> bool:
        return self >= Life.COMPLETED


@dataclass(slots=True)
class Generation:
    """One accepted request.  Owned by the event loop; the service moves its :attr:`life`."""

    request_id: str
    request: Request
    stream: RequestStream
    #: ``None`` only for a resumed stream that needs no engine (every token delivered).
    ticket: Ticket | None
    #: Who may resume or cancel it (:mod:`sluicegate.service.ownership`).
    owner: Owner
    priority_label: str = "interactive"
    #: The resume token itself, on the replica that created the request only (it is
    #: returned once, to the creator); ``None`` for a stream taken over from another.
    resume_token: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    life: Life = Life.LIVE
    #: Its output is a resumable stream (logged, continued elsewhere if stopped).
    resumable: bool = False
    #: Output tokens it started with (a resumed stream re-prefills what was delivered).
    num_resumed_tokens: int = 0
    first_write_time: float | None = None
    #: When the first letter or digit was written (time to first meaningful token).
    first_meaningful_time: float | None = None
    last_write_time: float | None = None
    num_tokens_written: int = 0
    #: Tokens written no later than a reader at its pace needed them (QoE, after Andes).
    num_tokens_on_time: int = 0
    #: A pipeline's output stages: the engine writes their head, ``stream`` is their tail.
    chain: StageChain | None = None
    #: A pipeline's retrieval before generation, in seconds.
    retrieval_seconds: float | None = None
    #: What a relaying core sends upstream for it (None: the engine here generates it).
    upstream_call: UpstreamCall | None = None
    #: ``n`` > 1 on the embedded core: its choices' sequences (``request`` is choice 0's).
    choices: Choices | None = None

    @property
    def produced(self) -> RequestStream:
        """The stream the engine writes (a pipeline's head; else :attr:`stream`)."""
        return self.stream if self.chain is None else self.chain.head

    @property
    def ended(self) -> bool:
        return self.life.ended

    @property
    def siblings(self) -> tuple[Request, ...]:
        """The sequences of its other choices (``n`` > 1 on the embedded core)."""
        return () if self.choices is None else self.choices.requests[1:]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of all its choices."""
        return sum(r.num_output_tokens for r in (self.request, *self.siblings))

    @property
    def queued(self) -> bool:
        """Still waiting in the queue (not yet handed to the engine)."""
        return self.ticket is not None and self.ticket.queued

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: the request id, a stream's id and resume token (for its
        creator), and the tenant's rate-limit state."""
        out = {"x-request-id": self.request_id}
        if self.resumable:
            out["x-sluicegate-stream-id"] = self.request_id
            if self.resume_token is not None:
                out[RESUME_TOKEN_HEADER] = self.resume_token
        if self.ticket is not None:
            out.update(self.ticket.admitted.headers())
        return out

    def timing(self) -> dict[str, float | None]:
        """Where this request's time went, in seconds (``None``: that phase never came)."""
        request = self.request
        now = time.monotonic()
        first = self.stream.timings.first_token_time
        finish = self.stream.timings.finish_time or now
        scheduled = request.first_scheduled_time
        tpot = None
        if first is not None and request.num_output_tokens > 1:
            tpot = (finish - first) / (request.num_output_tokens - 1)
        return {
            "queue_wait_seconds": None if scheduled is None else scheduled - request.arrival_time,
            "prefill_seconds": None
            if scheduled is None or first is None
            else max(0.0, first - scheduled),
            "ttft_seconds": None
            if self.first_write_time is None
            else self.first_write_time - request.arrival_time,
            "ttfmt_seconds": None
            if self.first_meaningful_time is None
            else self.first_meaningful_time - request.arrival_time,
            "tpot_seconds": tpot,
            "e2e_seconds": now - request.arrival_time,
            "paused_seconds": request.pause.total_seconds,
            # What admission predicted its time to first token would be (None: not
            # predicted, e.g. static admission).
            "predicted_ttft_seconds": None
            if self.ticket is None
            else self.ticket.predicted_ttft_seconds,
            # ... and the objective it was admitted to meet.
            "ttft_objective_seconds": None
            if self.ticket is None
            else self.ticket.ttft_objective_seconds,
            **(
                {}
                if self.retrieval_seconds is None
                else {"retrieval_seconds": self.retrieval_seconds}
            ),
        }

    def record_write(self, num_tokens: int) -> tuple[float | None, list[float]]:
        """Delivery timing of one write carrying ``num_tokens`` tokens.

        Returns (time to first token if this write carried the first, else None; the
        inter-token gaps it implies): as delivered, the first token of a write waited the
        whole gap since the previous write and the others arrived with it.
        """
        if num_tokens <= 0:
            return None, []
        now = time.monotonic()
        ttft = None
        gaps: list[float] = []
        if self.first_write_time is None:
            self.first_write_time = now
            ttft = now - self.request.arrival_time
        else:
            assert self.last_write_time is not None
            gaps.append(now - self.last_write_time)
        gaps.extend(0.0 for _ in range(num_tokens - 1))
        self.last_write_time = now
        self.num_tokens_written += num_tokens
        return ttft, gaps


def new_request_id(prefix: str) -> str:
    """An unguessable id (128 random bits).  Still not a credential: resuming or cancelling
    also needs the owner's API key, or in open mode the resume token
    (:mod:`sluicegate.service.ownership`)."""
    return f"{prefix}-{secrets.token_hex(16)}"


def finish_reason_text(reason: FinishReason | None) -> str | None:
    """A finish reason as OpenAI names it."""
    if reason is None:
        return None
    if reason in (
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.CONTENT_FILTER,
        FinishReason.TOOL_CALLS,
    ):
        return reason.value
    return "stop" if reason == FinishReason.ABORT else "error"


def completed_generation(
    request_id: str,
    prompt_ids: list[int],
    output_ids: list[int],
    sampling: SamplingParams,
    owner: Owner,
) -> Generation:
    """A resumed stream whose every token was delivered (only its end was not logged): it
    ends at once, without the engine (nor the service's live requests)."""
    request = Request(request_id, prompt_ids, sampling, all_token_ids=[*prompt_ids, *output_ids])
    stream = RequestStream(request_id)
    stream.put(
        RequestOutput(request_id, "", 0, len(prompt_ids), len(output_ids), FinishReason.LENGTH)
    )
    return Generation(request_id, request, stream, None, owner, num_resumed_tokens=len(output_ids))


def unresumable_choices(
    request_id: str, prompt_ids: list[int], sampling: SamplingParams, owner: Owner
) -> Generation:
    """A stream of ``n`` > 1 choices that its replica stopped before the end: its choices'
    tokens are logged interleaved, so it is not continued; it ends at once (without the
    engine) with an error event saying to send the request again, logged like any end."""
    request = Request(request_id, prompt_ids, sampling)
    stream = RequestStream(request_id)
    message = (
        f"This stream of n={sampling.n} choices stopped before its end (its replica drained, "
        "gave it up or died), and a stream of several choices is not continued: the events "
        "before this one are all it has. Send the request again."
    )
    stream.put(
        RequestOutput(
            request_id,
            "",
            0,
            len(prompt_ids),
            0,
            FinishReason.ERROR,
            error=message,
            failure=APIError(
                409, message, code="choices_not_resumable", error_type="choices_not_resumable"
            ),
        )
    )
    return Generation(request_id, request, stream, None, owner)
