"""What a run records: one :class:`Sample` per planned request, and server time series.

All times are seconds on the bench's monotonic clock, as offsets: a request's
``sent_offset_seconds`` from the start of the run, its token times from when it was sent.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from sluicegate.bench.schedule import PlannedRequest

REJECTION_STATUSES = (429, 503)


class Outcome(enum.StrEnum):
    """How one HTTP attempt ended."""

    COMPLETED = "completed"  # the stream ended with [DONE]
    DISCONNECTED = "disconnected"  # the client left on purpose after k tokens
    REJECTED = "rejected"  # 429/503, or an error event with retry_after_ms, before any token
    ERROR = "error"  # another HTTP error, or an error event in the stream
    TIMEOUT = "timeout"  # the socket read timed out
    ABORTED = "aborted"  # cut by the bench at the end of the drain window
    CONNECT_ERROR = "connect_error"  # no HTTP response at all


@dataclass(slots=True)
class Attempt:
    """One HTTP request and what came back."""

    sent_offset_seconds: float
    status: int = 0
    outcome: Outcome = Outcome.CONNECT_ERROR
    error: str | None = None
    #: The error's ``code`` (``slo_unreachable``, ``queue_full``, ...), when it had one.
    error_code: str | None = None
    #: When to come back: ``retry-after-ms``, else ``Retry-After``, else an error event's
    #: ``retry_after_ms``.
    retry_after_seconds: float | None = None
    #: ``x-sluicegate-refusal`` of a refusal by objective: ``slo_unreachable`` (a seat is
    #: held at its Retry-After) or ``overloaded`` (none is); None for other servers.
    refusal: str | None = None
    #: Seconds since sent when the refusal arrived (the response head, or the error
    #: event); a retry is due this long plus ``retry_after_seconds`` after sending.
    refused_after_seconds: float | None = None
    #: The refusal came as a final SSE error event of an admitted stream, not an HTTP status.
    refused_in_stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    e2e_seconds: float | None = None
    #: (seconds since sent, tokens delivered by that SSE event), token-bearing events only.
    token_events: list[tuple[float, int]] = field(default_factory=list)
    #: A Sluicegate server's own figures from the final usage (``usage.sluicegate``): its
    #: time to first token, and the objective it admitted the request to meet (None
    #: from other servers, and under static admission).
    server_ttft_seconds: float | None = None
    ttft_objective_seconds: float | None = None

    @property
    def past_objective(self) -> bool | None:
        """Admitted by a server that promised it a time to first token, did it miss it?
        (None: no promise to judge, or no first token.)"""
        objective, ttft = self.ttft_objective_seconds, self.server_ttft_seconds
        return None if objective is None or ttft is None else ttft > objective

    @property
    def ttft_seconds(self) -> float | None:
        return self.token_events[0][0] if self.token_events else None

    @property
    def tpot_seconds(self) -> float | None:
        """(last token time - first token time) / (tokens - 1); None below two tokens."""
        if self.completion_tokens < 2 or not self.token_events:
            return None
        return (self.token_events[-1][0] - self.token_events[0][0]) / (self.completion_tokens - 1)

    def token_times(self) -> list[float]:
        """Arrival time of each token (a coalesced event delivers all its tokens at once)."""
        return [t for t, n in self.token_events for _ in range(n)]

    def itl_seconds(self) -> list[float]:
        """Gap before each token after the first, as delivered (0 within one event)."""
        return [b - a for a, b in itertools.pairwise(self.token_times())]

    @property
    def admitted(self) -> bool:
        """The server took the request and did not refuse it later (it may have failed)."""
        return self.status == 200 and self.outcome is not Outcome.REJECTED

    @property
    def refused_by_status(self) -> bool:
        """Refused with an HTTP 429/503 (not by an error event after being admitted)."""
        return self.outcome is Outcome.REJECTED and self.status in REJECTION_STATUSES

    @property
    def retry_due_offset_seconds(self) -> float | None:
        """When a retry is due, in run time: the refusal's arrival plus the advertised wait."""
        if self.retry_after_seconds is None or self.refused_after_seconds is None:
            return None
        return self.sent_offset_seconds + self.refused_after_seconds + self.retry_after_seconds

    @property
    def served(self) -> bool:
        """The server took the request (a token came, or it ran to the end)."""
        return self.outcome in (Outcome.COMPLETED, Outcome.DISCONNECTED) or bool(self.token_events)

    def to_json(self) -> dict[str, Any]:
        return {
            "sent_offset_seconds": round(self.sent_offset_seconds, 6),
            "status": self.status,
            "outcome": self.outcome.value,
            "error": self.error,
            "error_code": self.error_code,
            "retry_after_seconds": self.retry_after_seconds,
            "refusal": self.refusal,
            "refused_after_seconds": self.refused_after_seconds,
            "refused_in_stream": self.refused_in_stream,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "ttft_seconds": self.ttft_seconds,
            "tpot_seconds": self.tpot_seconds,
            "e2e_seconds": self.e2e_seconds,
            "token_events": [[round(t, 6), n] for t, n in self.token_events],
        }


@dataclass(slots=True)
class Sample:
    """One planned request: its plan and its attempts (a retry after 429/503 is the second)."""

    planned: PlannedRequest
    attempts: list[Attempt] = field(default_factory=list)
    #: Why it was never sent (too many connections open, or the run was stopped).
    not_sent_reason: str | None = None
    #: Actual send time minus scheduled send time (how late the generator was).
    send_lateness_seconds: float | None = None

    @property
    def first(self) -> Attempt | None:
        return self.attempts[0] if self.attempts else None

    @property
    def outcome(self) -> str:
        first = self.first
        return "not_sent" if first is None else first.outcome.value

    @property
    def rejected(self) -> bool:
        first = self.first
        return first is not None and first.outcome is Outcome.REJECTED

    @property
    def retry(self) -> Attempt | None:
        return self.attempts[1] if len(self.attempts) > 1 else None

    @property
    def retry_lateness_seconds(self) -> float | None:
        """How long after the advertised time the retry was sent (None: no retry)."""
        first, retry = self.first, self.retry
        due = None if first is None else first.retry_due_offset_seconds
        if retry is None or due is None:
            return None
        return retry.sent_offset_seconds - due

    def to_json(self) -> dict[str, Any]:
        p = self.planned
        return {
            "index": p.index,
            "stage": p.stage_index,
            "scheduled_offset_seconds": round(p.send_offset_seconds, 6),
            "send_lateness_seconds": self.send_lateness_seconds,
            "tenant": p.tenant,
            "client_class": p.client_class.value,
            "target_prompt_tokens": p.target_prompt_tokens,
            "max_tokens": p.max_tokens,
            "disconnect_after_tokens": p.disconnect_after_tokens,
            "read_tokens_per_second": p.read_tokens_per_second,
            "outcome": self.outcome,
            "not_sent_reason": self.not_sent_reason,
            "retry_lateness_seconds": self.retry_lateness_seconds,
            "attempts": [a.to_json() for a in self.attempts],
        }


@dataclass(slots=True)
class SeriesPoint:
    """One scrape of the server's ``/metrics``."""

    offset_seconds: float
    resident_memory_bytes: float | None = None
    kv_cache_usage_ratio: float | None = None
    requests_waiting: float | None = None
    requests_running: float | None = None
    streams_paused: float | None = None
    concurrency_limit: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "offset_seconds": round(self.offset_seconds, 4),
            "resident_memory_bytes": self.resident_memory_bytes,
            "kv_cache_usage_ratio": self.kv_cache_usage_ratio,
            "requests_waiting": self.requests_waiting,
            "requests_running": self.requests_running,
            "streams_paused": self.streams_paused,
            "concurrency_limit": self.concurrency_limit,
        }
