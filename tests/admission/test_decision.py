from __future__ import annotations

import pytest

from sluicegate.admission.decision import (
    RateLimitSnapshot,
    Rejection,
    RejectReason,
    format_reset_duration,
    queue_full_rejection,
    queue_timeout_rejection,
    slo_rejection,
)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "1ms"),
        (0.25, "250ms"),
        (0.017, "17ms"),
        (0.999, "999ms"),
        (1.0, "1s"),
        (7.66, "7.66s"),
        (59.5, "59.5s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (90.25, "1m30.25s"),
        (3723.0, "1h2m3s"),
    ],
)
def test_reset_durations_are_formatted_like_openai(seconds: float, text: str) -> None:
    assert format_reset_duration(seconds) == text


def test_rate_limit_headers() -> None:
    snapshot = RateLimitSnapshot(
        limit_requests=60,
        remaining_requests=0,
        reset_requests_seconds=1.0,
        limit_tokens=150_000,
        remaining_tokens=149_000,
        reset_tokens_seconds=0.4,
    )
    assert snapshot.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149000",
        "x-ratelimit-reset-tokens": "400ms",
    }
    only_tokens = RateLimitSnapshot(limit_tokens=10, remaining_tokens=3, reset_tokens_seconds=360)
    assert only_tokens.headers() == {
        "x-ratelimit-limit-tokens": "10",
        "x-ratelimit-remaining-tokens": "3",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert RateLimitSnapshot().headers() == {}


def test_rejection_headers_round_retry_after_up() -> None:
    rejection = Rejection(
        RejectReason.RATE_LIMITED_REQUESTS,
        429,
        "slow down",
        0.2,
        RateLimitSnapshot(limit_requests=1, remaining_requests=0, reset_requests_seconds=0.2),
    )
    assert rejection.headers() == {
        "x-ratelimit-limit-requests": "1",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "200ms",
        "retry-after": "1",
        "retry-after-ms": "200",  # exact, for clients that read it
    }
    assert rejection.error_code == "rate_limit_exceeded"
    assert Rejection(RejectReason.CIRCUIT_OPEN, 503, "m", 2.01).retry_after_header == "3"
    not_retryable = Rejection(RejectReason.RATE_LIMITED_TOKENS, 400, "m", code="request_too_large")
    assert not_retryable.retry_after_header is None
    assert not_retryable.headers() == {}
    assert not_retryable.error_code == "request_too_large"


def test_queue_rejections() -> None:
    full = queue_full_rejection("interactive max_queued_requests limit of 8 reached", 4.2)
    assert full.reason is RejectReason.QUEUE_FULL
    assert full.http_status == 429
    assert "max_queued_requests limit of 8" in full.message
    assert full.headers()["retry-after"] == "5"
    timeout = queue_timeout_rejection(31.0, 30.0, 12.0)
    assert timeout.reason is RejectReason.QUEUE_TIMEOUT
    assert timeout.http_status == 503
    assert "max_queue_wait_seconds limit of 30s" in timeout.message
    assert timeout.headers()["retry-after"] == "12"


def test_reason_values_are_the_metric_labels() -> None:
    assert [r.value for r in RejectReason] == [
        "rate_limited_requests",
        "rate_limited_tokens",
        "concurrency",
        "queue_full",
        "queue_timeout",
        "slo_unreachable",
        "circuit_open",
        "draining",
        "auth",
        "store_unavailable",
    ]


def test_a_refusal_in_a_stream_says_what_its_headers_would() -> None:
    """A streamed request refused after its 200 (from the queue) gets the headers'
    contents in its final error event: when to come back, and whether a seat is held."""
    for held, refusal in ((True, "slo_unreachable"), (False, "overloaded")):
        error = slo_rejection(2.0, 1.0, 1.5, held=held).to_error()
        event = error.event_body()["error"]
        assert event["retry_after_ms"] == 1500 and event["refusal"] == refusal
        assert event["code"] == "slo_unreachable"
    assert "refusal" not in queue_full_rejection("full", 1.0).to_error().event_body()["error"]
