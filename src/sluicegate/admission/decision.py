"""What the front door decided, in a shape the api layer turns into an HTTP response.

Every refusal is a :class:`Rejection`: a reason (also the ``rejections_total{reason}``
label), an HTTP status, a message that says which limit was hit and what to do, a
``Retry-After`` and OpenAI's ``x-ratelimit-*`` header values.

Status codes follow one rule: **429** when a configured limit was hit that the client can
back off from (rate limits, concurrency caps, a full queue), **503** when the server
cannot keep up or is going away (circuit breaker, queue timeout, draining), **401** for
authentication, and **400** for a request that no amount of waiting would admit (it is
larger than the token bucket can ever hold).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from sluicegate.admission.retry_after import retry_after_header_value
from sluicegate.errors import APIError


class RejectReason(enum.StrEnum):
    """Why a request was refused; the values are the metric label values."""

    RATE_LIMITED_REQUESTS = "rate_limited_requests"
    RATE_LIMITED_TOKENS = "rate_limited_tokens"
    CONCURRENCY = "concurrency"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    #: Its predicted time to first token exceeds its class's objective.
    SLO_UNREACHABLE = "slo_unreachable"
    CIRCUIT_OPEN = "circuit_open"
    DRAINING = "draining"
    AUTH = "auth"
    #: ``store_failure_mode fail_closed`` and the shared store is unreachable.
    STORE_UNAVAILABLE = "store_unavailable"


# OpenAI's error ``code`` for each reason (a 400 "too large" overrides it).
_CODE_BY_REASON: dict[RejectReason, str] = {
    RejectReason.RATE_LIMITED_REQUESTS: "rate_limit_exceeded",
    RejectReason.RATE_LIMITED_TOKENS: "rate_limit_exceeded",
    RejectReason.CONCURRENCY: "rate_limit_exceeded",
    RejectReason.QUEUE_FULL: "queue_full",
    RejectReason.QUEUE_TIMEOUT: "queue_timeout",
    RejectReason.SLO_UNREACHABLE: "slo_unreachable",
    RejectReason.CIRCUIT_OPEN: "server_overloaded",
    RejectReason.DRAINING: "server_draining",
    RejectReason.AUTH: "invalid_api_key",
    RejectReason.STORE_UNAVAILABLE: "store_unavailable",
}


def format_reset_duration(seconds: float) -> str:
    """Format a duration the way OpenAI's ``x-ratelimit-reset-*`` headers do (Go style).

    ``0.25 -> "250ms"``, ``1 -> "1s"``, ``7.66 -> "7.66s"``, ``360 -> "6m0s"``,
    ``3723 -> "1h2m3s"``.  Rounded *up* to the millisecond so a client that waits exactly
    this long is never early.
    """
    if seconds <= 0.0 or math.isnan(seconds):
        return "0s"
    if math.isinf(seconds):
        return "inf"
    # The small offset keeps float noise (0.25 * 1000 = 250.00000000000003) from adding 1 ms.
    total_ms = max(1, math.ceil(seconds * 1000.0 - 1e-6))
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, seconds_ms = divmod(rest_ms, 60_000)
    if seconds_ms % 1000 == 0:
        secs = str(seconds_ms // 1000)
    else:
        secs = f"{seconds_ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(slots=True)
class RateLimitSnapshot:
    """A tenant's request and token buckets at decision time (``None``: no such limit).

    ``limit_*`` is the bucket's capacity (its burst), ``remaining_*`` what is left after
    this decision, ``reset_*_seconds`` the time until the bucket is full again.
    """

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_seconds: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_seconds: float | None = None

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, one trio per configured limit."""
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests or 0)
            out["x-ratelimit-reset-requests"] = format_reset_duration(
                self.reset_requests_seconds or 0.0
            )
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens or 0)
            out["x-ratelimit-reset-tokens"] = format_reset_duration(
                self.reset_tokens_seconds or 0.0
            )
        return out


@dataclass(slots=True)
class Rejection:
    """A refused request.  ``message`` is for the client: which limit, and what to do.

    ``retry_after_seconds`` is ``None`` when waiting would not help (bad credentials, a
    request larger than the limit itself); otherwise it becomes ``Retry-After``.
    """

    reason: RejectReason
    http_status: int
    message: str
    retry_after_seconds: float | None = None
    rate_limits: RateLimitSnapshot | None = None
    #: OpenAI error ``code``; ``None`` means the default for ``reason``.
    code: str | None = None
    #: ``x-sluicegate-refusal`` of a refusal by objective: ``slo_unreachable`` (a seat is
    #: held at ``Retry-After``) or ``overloaded`` (none is); None for other rejections.
    refusal: str | None = None

    @property
    def error_code(self) -> str:
        return self.code if self.code is not None else _CODE_BY_REASON[self.reason]

    @property
    def retry_after_header(self) -> str | None:
        """``Retry-After`` in whole seconds, rounded up, at least 1; ``None`` if not retryable."""
        if self.retry_after_seconds is None:
            return None
        return str(retry_after_header_value(self.retry_after_seconds))

    def headers(self) -> dict[str, str]:
        """Every response header this rejection implies."""
        out = self.rate_limits.headers() if self.rate_limits is not None else {}
        retry_after = self.retry_after_header
        if retry_after is not None and self.retry_after_seconds is not None:
            out["retry-after"] = retry_after
            # Exact, for clients that read it (OpenAI's SDKs prefer it to whole seconds).
            # Rounded up: a client that waits exactly this long is never early.
            out["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_seconds * 1000 - 1e-6)))
        if self.refusal is not None:
            out["x-sluicegate-refusal"] = self.refusal
        if self.reason is RejectReason.AUTH:
            out["www-authenticate"] = "Bearer"
        return out

    def to_error(self) -> APIError:
        """This rejection as the error the client sees."""
        return APIError(
            self.http_status,
            self.message,
            code=self.error_code,
            error_type=self.reason.value if self.http_status != 400 else "invalid_request_error",
            headers=self.headers(),
        )


def queue_full_rejection(detail: str, retry_after_seconds: float) -> Rejection:
    """The queue could not take the request (policy ``reject``, or a ``drop-oldest`` victim).

    ``detail`` names the limit (see :attr:`FairQueue.offer`'s result); ``retry_after_seconds``
    should come from :meth:`ServiceRateEstimator.retry_after_seconds`.
    """
    return Rejection(
        RejectReason.QUEUE_FULL,
        429,
        f"The server's request queue is full ({detail}). "
        f"Retry after {retry_after_header_value(retry_after_seconds)}s.",
        retry_after_seconds,
    )


def queue_timeout_rejection(
    waited_seconds: float, max_wait_seconds: float, retry_after_seconds: float
) -> Rejection:
    """The request waited in (or for) the queue longer than ``max_queue_wait_seconds``."""
    return Rejection(
        RejectReason.QUEUE_TIMEOUT,
        503,
        f"The request waited {waited_seconds:.1f}s for the engine, past the "
        f"max_queue_wait_seconds limit of {max_wait_seconds:g}s; the server is overloaded. "
        f"Retry after {retry_after_header_value(retry_after_seconds)}s.",
        retry_after_seconds,
    )


def slo_rejection(
    predicted_ttft_seconds: float,
    objective_seconds: float,
    retry_after_seconds: float,
    *,
    held: bool = True,
    promised: int = 0,
    delayed: int = 0,
) -> Rejection:
    """Admitting it now would miss its time-to-first-token objective (or, with
    ``promised``, make clients promised a seat miss theirs; with ``delayed``, make
    requests whose prompts the engine prefills together with it miss theirs).  ``held``: a
    seat is held for it at ``retry_after_seconds`` (else the server is overloaded past
    what it promises)."""
    if promised:
        why = (
            f"the seats that free within it are promised to {promised} client(s) refused "
            f"earlier (it would start in {predicted_ttft_seconds:.2f}s and make them late)"
        )
    elif delayed:
        why = (
            f"the engine prefills the prompts it holds together: it would see its first "
            f"token in {predicted_ttft_seconds:.2f}s and make {delayed} request(s) being "
            "prefilled beside it miss theirs"
        )
    else:
        why = f"predicted {predicted_ttft_seconds:.2f}s"
    if held:
        when = (
            f"Retry after {retry_after_seconds:.2f}s with the same request: a seat is held "
            "for it then."
        )
    else:
        when = (
            f"The server is overloaded past what it can promise; retry after "
            f"{retry_after_seconds:.2f}s (no seat is held)."
        )
    rejection = Rejection(
        RejectReason.SLO_UNREACHABLE,
        429,
        f"The server cannot start this request within its {objective_seconds:g}s "
        f"time-to-first-token objective now ({why}). {when}",
        retry_after_seconds,
    )
    rejection.refusal = "slo_unreachable" if held else "overloaded"
    return rejection


def deadline_rejection(predicted_seconds: float | None, deadline_in_seconds: float) -> Rejection:
    """Its answer would not be done by the deadline it stated (``x-sluicegate-deadline``):
    predicted at admission, or the deadline passed while it was queued (None).  No
    ``Retry-After``: coming back later cannot meet an absolute deadline."""
    if predicted_seconds is None:
        why = "its deadline (x-sluicegate-deadline) passed while it waited for the engine"
    else:
        why = (
            f"it would finish in about {predicted_seconds:.1f}s, after its deadline "
            f"(x-sluicegate-deadline) {max(0.0, deadline_in_seconds):.1f}s from now"
        )
    return Rejection(
        RejectReason.SLO_UNREACHABLE,
        429,
        f"The server cannot finish this request in time: {why}.",
        None,
        code="deadline_unreachable",
    )
