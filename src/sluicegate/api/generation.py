"""From a validated OpenAI request to a running sequence, and back to text."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluicegate.admission.tenants import Tenant
from sluicegate.api.front_door import Ticket, rejection_error
from sluicegate.api.runtime import Runtime
from sluicegate.api.schemas import _Common, stop_sequences
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.errors import APIError, invalid_param
from sluicegate.metrics.request_log import request_logger
from sluicegate.metrics.tracing import RequestTimeline, record_request_spans
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from sluicegate.stream.flow import StreamFlow

if TYPE_CHECKING:
    from sluicegate.api.session import StreamSession


@dataclass(slots=True)
class Generation:
    """One accepted request: its id, sequence, output stream and delivery timings."""

    request_id: str
    request: Request
    stream: RequestStream
    priority_label: str = "interactive"
    created: int = field(default_factory=lambda: int(time.time()))
    finished: bool = False
    recorded: bool = False
    first_write_time: float | None = None
    last_write_time: float | None = None
    num_tokens_written: int = 0
    ticket: Ticket | None = None
    flow: StreamFlow | None = None
    #: Stopped with its stream kept resumable (drain, detached too long, lease lost): the
    #: stream ends with a notice instead of a finish, and may continue on any replica.
    drained: bool = False
    #: The resumable stream this request feeds (streamed requests only).
    session: StreamSession | None = None
    #: Stopped to continue elsewhere: its token reservation stays spent (the continuation
    #: is not charged again), rather than refunded.
    keep_reservation: bool = False
    #: Output tokens it started with (a resumed stream re-prefills what was delivered).
    num_resumed_tokens: int = 0

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
            "tpot_seconds": tpot,
            "e2e_seconds": now - request.arrival_time,
            "paused_seconds": self.flow.total_paused_seconds if self.flow is not None else 0.0,
        }

    @property
    def dispatched(self) -> bool:
        return self.ticket is None or self.ticket.dispatched

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: the request id and the tenant's rate-limit state."""
        out = {"x-request-id": self.request_id}
        if self.session is not None:
            out["x-sluicegate-stream-id"] = self.request_id
        if self.ticket is not None:
            out.update(self.ticket.admitted.headers())
        return out

    def record_write(self, runtime: Runtime, num_tokens: int) -> None:
        """Delivery timing of one write carrying ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        metrics = runtime.metrics
        if self.first_write_time is None:
            self.first_write_time = now
            metrics.time_to_first_token_seconds.labels(self.priority_label).observe(
                now - self.request.arrival_time
            )
            gap_tokens = num_tokens - 1
        else:
            assert self.last_write_time is not None
            # As delivered: the first token of this write waited the whole gap, the
            # others arrived with it.
            metrics.inter_token_latency_seconds.observe(now - self.last_write_time)
            gap_tokens = num_tokens - 1
        for _ in range(gap_tokens):
            metrics.inter_token_latency_seconds.observe(0.0)
        self.last_write_time = now
        self.num_tokens_written += num_tokens


def new_request_id(prefix: str) -> str:
    """An unguessable id (128 random bits): it is also the stream id that resumes a stream,
    so knowing it must be as good as having created it (besides the tenant check)."""
    return f"{prefix}-{secrets.token_hex(16)}"


def usage(output: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": output.num_output_tokens,
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
    }


def resolve_max_tokens(runtime: Runtime, requested: int | None, num_prompt_tokens: int) -> int:
    """Check the context limits; say which one is exceeded and by how much."""
    limit = runtime.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens ({num_prompt_tokens - limit + 1} too many to leave "
            "room for one generated token). Shorten the prompt.",
            param="messages",
            code="context_length_exceeded",
        )
    room = limit - num_prompt_tokens
    if requested is None:
        return min(runtime.settings.default_max_tokens, room)
    if requested < 1:
        raise invalid_param("max_tokens", f"max_tokens must be at least 1; got {requested}")
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and max_tokens is {requested}, "
            f"{num_prompt_tokens + requested - limit} over the limit. "
            f"Use max_tokens <= {room} or a shorter prompt.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def build_sampling(req: _Common, max_tokens: int) -> SamplingParams:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        seed=req.seed if req.seed is not None else secrets.randbits(63),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        stop=stop_sequences(req.stop),
        ignore_eos=req.ignore_eos,
    )


async def start_generation(
    runtime: Runtime,
    tenant: Tenant,
    priority: str | None,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    max_tokens_per_second: float | None = None,
    *,
    output_token_ids: Sequence[int] = (),
    resumed: bool = False,
) -> Generation:
    """Admit and queue a request; it reaches the engine when the front door dispatches it.

    A ``resumed`` stream continues on this replica after ``output_token_ids`` (delivered
    elsewhere): it re-prefills them, and its tenant's rate limits are not charged again.
    """
    front_door = runtime.front_door
    if front_door is None or not runtime.ready:
        raise APIError(
            503,
            "The model is still loading; retry shortly.",
            code="not_ready",
            headers={"retry-after": "2"},
        )
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        all_token_ids=[*prompt_ids, *output_token_ids],
    )
    pace = max_tokens_per_second or tenant.max_tokens_per_second
    if tenant.max_tokens_per_second and max_tokens_per_second:
        pace = min(max_tokens_per_second, tenant.max_tokens_per_second)
    if pace:
        request.min_token_interval_seconds = 1.0 / pace
    stream = RequestStream(request_id)
    priority_class = front_door.priority_of(tenant, priority)
    ticket = await front_door.enter(
        tenant, priority_class, request, stream, rate_limited=not resumed
    )
    if not resumed:
        runtime.metrics.prompt_tokens_total.inc(len(prompt_ids))
    generation = Generation(
        request_id, request, stream, priority_class.value, ticket=ticket,
        num_resumed_tokens=len(output_token_ids),
    )  # fmt: skip
    runtime.generations[request_id] = generation
    return generation


def abort_generation(runtime: Runtime, generation: Generation) -> None:
    """The client went away (or cancelled): abort the sequence before the next step."""
    if generation.finished:
        return
    generation.finished = True
    ticket = generation.ticket
    if ticket is not None and not ticket.dispatched:
        if runtime.front_door is not None:
            runtime.front_door.cancel(ticket)
    elif runtime.core is not None:
        runtime.core.abort_request(generation.request_id)
    runtime.metrics.cancellations_total.inc()
    record_finish(runtime, generation, "cancelled")


def drain_generation(runtime: Runtime, generation: Generation) -> None:
    """Shutdown reached its deadline: stop this sequence; its client is told to resume."""
    stop_generation(runtime, generation, "drained")


def stop_generation(runtime: Runtime, generation: Generation, status: str) -> None:
    """Stop a sequence whose stream stays resumable (recorded with ``status``)."""
    if generation.finished:
        return
    generation.drained = True
    generation.finished = True
    ticket = generation.ticket
    if ticket is not None and not ticket.dispatched and runtime.front_door is not None:
        runtime.front_door.cancel(ticket)
        request = generation.request
        generation.stream.put(
            RequestOutput(request.request_id, "", 0, request.num_prompt_tokens, 0,
                          FinishReason.ABORT)
        )  # fmt: skip
    elif runtime.core is not None:
        runtime.core.abort_request(generation.request_id)
    record_finish(runtime, generation, status)


def drain_notice(generation: Generation) -> dict[str, object]:
    """The final event of a stream cut short by shutdown."""
    return {
        "error": {
            "message": (
                "The server is shutting down and stopped this stream before it finished. "
                f"Resume it with GET /v1/streams/{generation.request_id} (with Last-Event-ID) "
                "on any replica, or retry the request."
            ),
            "type": "server_draining",
            "param": None,
            "code": "server_draining",
            "stream_id": generation.request_id,
        }
    }


def record_finish(runtime: Runtime, generation: Generation, status: str) -> None:
    """Per-request metrics, log line and spans, once, when the request ends any way."""
    if generation.recorded:
        return
    generation.recorded = True
    runtime.generations.pop(generation.request_id, None)
    if generation.ticket is not None and runtime.front_door is not None:
        runtime.front_door.finished(generation.ticket, keep_reservation=generation.keep_reservation)
    metrics = runtime.metrics
    request = generation.request
    timing = generation.timing()
    metrics.requests_total.labels(status).inc()
    metrics.generation_tokens_total.inc(request.num_output_tokens - generation.num_resumed_tokens)
    metrics.e2e_request_latency_seconds.labels(generation.priority_label).observe(
        timing["e2e_seconds"] or 0.0
    )
    if timing["queue_wait_seconds"] is not None:
        metrics.queue_wait_seconds.labels(generation.priority_label).observe(
            timing["queue_wait_seconds"]
        )
        runtime.queue_wait_window.add(timing["queue_wait_seconds"])
    if timing["prefill_seconds"] is not None:
        metrics.prefill_seconds.observe(timing["prefill_seconds"])
    if timing["ttft_seconds"] is not None:
        runtime.ttft_window.add(timing["ttft_seconds"])
    if timing["tpot_seconds"] is not None:
        metrics.time_per_output_token_seconds.observe(timing["tpot_seconds"])
        runtime.tpot_window.add(timing["tpot_seconds"])
    ticket = generation.ticket
    tenant = ticket.tenant.name if ticket is not None else "default"
    request_logger().info(
        "request",
        request_id=generation.request_id,
        tenant=tenant,
        priority=generation.priority_label,
        status=status,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        prompt_tokens=request.num_prompt_tokens,
        output_tokens=request.num_output_tokens,
        **timing,
        preemptions=request.num_preemptions,
    )
    record_request_spans(
        RequestTimeline(
            request_id=generation.request_id,
            tenant=tenant,
            status=status,
            arrival=request.arrival_time,
            dispatched=ticket.dispatched_at if ticket is not None else None,
            first_token=generation.stream.timings.first_token_time,
            finished=time.monotonic(),
            prompt_tokens=request.num_prompt_tokens,
            output_tokens=request.num_output_tokens,
        )
    )


def engine_failure(generation: Generation, output: RequestOutput) -> APIError:
    ticket = generation.ticket
    if ticket is not None and ticket.rejection is not None:
        return rejection_error(ticket.rejection)  # refused after queueing (dropped, expired)
    return APIError(
        500,
        f"The engine failed while generating: {output.error or 'unknown error'}. "
        "The request was not completed; it is safe to retry.",
        code="engine_error",
    )


def finish_reason_text(reason: FinishReason | None) -> str | None:
    if reason is None:
        return None
    if reason in (FinishReason.STOP, FinishReason.LENGTH):
        return reason.value
    return "stop" if reason == FinishReason.ABORT else "error"
