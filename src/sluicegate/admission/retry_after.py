"""``Retry-After`` from the measured drain rate: queue ahead ÷ service rate.

The rate is measured over a sliding window of completions kept in fixed time bins, so
memory and cost stay constant whatever the request rate.  It measures *throughput*,
which understates capacity while the server is underloaded; that only happens when
nothing is queued, which is exactly when no ``Retry-After`` is needed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from sluicegate.types import Clock


def retry_after_header_value(seconds: float, max_seconds: float = math.inf) -> int:
    """Seconds for a ``Retry-After`` header: clamped to ``[1, max_seconds]``, rounded up."""
    if math.isnan(seconds):
        seconds = 1.0
    clamped = min(max(seconds, 1.0), max(max_seconds, 1.0))
    # The small offset keeps float noise (2.0000000000000004) from adding a whole second.
    return max(1, math.ceil(clamped - 1e-9))


@dataclass(slots=True)
class _Bin:
    index: int
    first_at: float
    last_at: float
    num_completions: int = 0
    num_tokens: int = 0


class ServiceRateEstimator:
    """Completions per second and tokens per second over the last ``window_seconds``.

    With ``n`` completions in the window, the first at ``t_first`` and the last at
    ``t_last``, the rate is ``min((n - 1) / (t_last - t_first), n / (now - t_first))``:
    exact for a steady stream whenever it is read, and falling while nothing completes (a
    stalled engine).  Tokens per second is that rate times the mean tokens per
    completion.  Until ``min_completions`` are in the window, the fallback rates are used.
    """

    def __init__(
        self,
        *,
        window_seconds: float = 10.0,
        num_bins: int = 20,
        min_completions: int = 5,
        fallback_requests_per_second: float = 1.0,
        fallback_tokens_per_second: float | None = None,
        max_retry_after_seconds: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if window_seconds <= 0.0 or num_bins < 1:
            raise ValueError("window_seconds must be > 0 and num_bins >= 1")
        if fallback_requests_per_second <= 0.0:
            raise ValueError("fallback_requests_per_second must be > 0")
        if max_retry_after_seconds < 1.0:
            raise ValueError("max_retry_after_seconds must be >= 1")
        self.window_seconds = window_seconds
        self.num_bins = num_bins
        self.min_completions = max(2, min_completions)
        self.fallback_requests_per_second = fallback_requests_per_second
        self.fallback_tokens_per_second = fallback_tokens_per_second
        self.max_retry_after_seconds = max_retry_after_seconds
        self._clock = clock
        self._bin_seconds = window_seconds / num_bins
        self._bins: deque[_Bin] = deque()

    def record_completion(self, num_tokens: int = 0, num_completions: int = 1) -> None:
        """Requests finished now; ``num_tokens`` is the work they took (prompt + output)."""
        now = self._clock()
        self._prune(now)
        index = math.floor(now / self._bin_seconds)
        bins = self._bins
        if not bins or bins[-1].index != index:
            bins.append(_Bin(index, now, now))
        last = bins[-1]
        last.last_at = now
        last.num_completions += num_completions
        last.num_tokens += num_tokens

    def requests_per_second(self) -> float | None:
        """Measured completions per second, or ``None`` before enough were seen."""
        rates = self._rates()
        return rates[0] if rates is not None else None

    def tokens_per_second(self) -> float | None:
        """Measured tokens per second, or ``None`` before enough completions were seen."""
        rates = self._rates()
        return rates[1] if rates is not None and rates[1] > 0.0 else None

    def estimate_wait_seconds(
        self, queue_ahead_requests: int, queue_ahead_tokens: int = 0
    ) -> float:
        """Time to drain what is ahead at the measured rate (the fallback before any).

        With both counts given the larger of the two estimates wins: a queue of few but
        long requests drains at its token rate, not its request rate.
        """
        rates = self._rates()
        rps = rates[0] if rates is not None else self.fallback_requests_per_second
        tps = rates[1] if rates is not None and rates[1] > 0.0 else self.fallback_tokens_per_second
        wait = queue_ahead_requests / rps if rps > 0.0 else self.max_retry_after_seconds
        if queue_ahead_tokens > 0 and tps:
            wait = max(wait, queue_ahead_tokens / tps)
        return wait

    def retry_after_seconds(self, queue_ahead_requests: int, queue_ahead_tokens: int = 0) -> float:
        """:meth:`estimate_wait_seconds` clamped to ``[1, max_retry_after_seconds]``."""
        wait = self.estimate_wait_seconds(queue_ahead_requests, queue_ahead_tokens)
        return min(max(wait, 1.0), self.max_retry_after_seconds)

    def _rates(self) -> tuple[float, float] | None:
        now = self._clock()
        self._prune(now)
        bins = self._bins
        num_completions = 0
        num_tokens = 0
        for b in bins:
            num_completions += b.num_completions
            num_tokens += b.num_tokens
        if num_completions < self.min_completions:
            return None
        first_at = bins[0].first_at
        since_first = now - first_at
        if since_first <= 0.0:
            return None
        rate = num_completions / since_first
        between = bins[-1].last_at - first_at
        if between > 0.0:
            rate = min(rate, (num_completions - 1) / between)
        return rate, rate * num_tokens / num_completions

    def _prune(self, now: float) -> None:
        first_kept = math.floor(now / self._bin_seconds) - self.num_bins + 1
        bins = self._bins
        while bins and bins[0].index < first_kept:
            bins.popleft()
