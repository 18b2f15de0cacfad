"""A token bucket: ``burst`` tokens of capacity, refilled at ``rate_per_second``.

Used twice per tenant: requests per second (one token per request) and tokens per minute
(prompt + ``max_tokens`` reserved at admission, reconciled with the real usage when the
request finishes).  Reconciliation may leave the bucket in debt (below zero): the debt is
repaid by refill before anything else is admitted, so underestimates are never free.

Not thread-safe: the event loop owns it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sluicegate.types import Clock


@dataclass(slots=True)
class Acquire:
    """The outcome of :meth:`TokenBucket.try_acquire`.

    ``retry_after_seconds`` is the exact time until the asked-for tokens will be
    available at the refill rate (0 when admitted).  ``exceeds_burst`` means the request
    is larger than the bucket can ever hold: waiting will not help, and
    ``retry_after_seconds`` is ``inf``.
    """

    admitted: bool
    #: Tokens left after this call; negative while the bucket is in debt.
    remaining: float
    retry_after_seconds: float
    #: Time until the bucket is full again.
    reset_seconds: float
    exceeds_burst: bool = False


class TokenBucket:
    """Continuous-refill token bucket with a fake-able clock.

    Float arithmetic with a tolerance of one part in 10⁹ of the burst, so that time
    deltas like ``0.3 - 0.2`` (0.09999999999999998) still refill a whole token.
    """

    __slots__ = ("_burst", "_clock", "_epsilon", "_rate", "_tokens", "_updated_at")

    def __init__(
        self,
        rate_per_second: float,
        burst: float,
        clock: Clock = time.monotonic,
        *,
        initial_tokens: float | None = None,
    ) -> None:
        if not rate_per_second > 0.0 or math.isinf(rate_per_second):
            raise ValueError(f"rate_per_second must be a positive number; got {rate_per_second}")
        if not burst > 0.0 or math.isinf(burst):
            raise ValueError(f"burst must be a positive number; got {burst}")
        self._rate = float(rate_per_second)
        self._burst = float(burst)
        self._clock = clock
        self._epsilon = 1e-9 * max(1.0, self._burst)
        self._tokens = self._burst if initial_tokens is None else float(initial_tokens)
        self._updated_at = clock()

    @property
    def rate_per_second(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def available(self) -> float:
        """Tokens in the bucket now (negative while in debt)."""
        self._refill()
        return self._tokens

    def reset_seconds(self) -> float:
        """Time until the bucket is full again."""
        self._refill()
        return self._reset_seconds()

    def peek(self) -> tuple[float, float]:
        """``(available(), reset_seconds())`` with one clock read."""
        self._refill()
        return self._tokens, self._reset_seconds()

    def try_acquire(self, n: float = 1.0) -> Acquire:
        """Take ``n`` tokens if they are all there; otherwise take nothing."""
        self._refill()
        tokens = self._tokens
        if n > self._burst + self._epsilon:
            return Acquire(False, tokens, math.inf, self._reset_seconds(), exceeds_burst=True)
        if tokens + self._epsilon >= n:
            tokens -= n
            if -self._epsilon < tokens < self._epsilon:
                tokens = 0.0
            self._tokens = tokens
            return Acquire(True, tokens, 0.0, self._reset_seconds())
        return Acquire(False, tokens, (n - tokens) / self._rate, self._reset_seconds())

    def charge(self, n: float) -> None:
        """Take ``n`` tokens unconditionally; the bucket may go into debt."""
        self._refill()
        self._tokens -= n

    def refund(self, n: float) -> None:
        """Give back ``n`` tokens (never above the burst)."""
        self._refill()
        self._tokens = min(self._burst, self._tokens + n)

    def _refill(self) -> None:
        now = self._clock()
        elapsed = now - self._updated_at
        if elapsed > 0.0:
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
            self._updated_at = now

    def _reset_seconds(self) -> float:
        missing = self._burst - self._tokens
        return missing / self._rate if missing > self._epsilon else 0.0
