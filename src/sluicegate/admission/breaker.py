"""A three-state circuit breaker driven by how the server is actually doing.

Two signals, each the p95 over a sliding time window: how long requests waited in the
queue, and how long one engine step took.  When either crosses its *enter* threshold
the breaker escalates at once::

    CLOSED ──► SHED_BATCH (batch class gets 503) ──► OPEN (interactive too, beyond capacity)

It relaxes one level at a time, and only when every signal has fallen below that level's
(lower) *exit* threshold **and** it has dwelt at least ``min_dwell_seconds`` in the
current state.  Separate thresholds plus the dwell time are the hysteresis that keeps it
from flapping.  Too few samples in the window count as "healthy": no traffic means no
queue.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sluicegate.types import Clock


class BreakerState(enum.IntEnum):
    """Ordered by severity."""

    CLOSED = 0
    SHED_BATCH = 1
    OPEN = 2

    @property
    def label(self) -> str:
        """Lower-case name for metrics and logs."""
        return self.name.lower()


@dataclass(slots=True, frozen=True)
class Threshold:
    """Enter a level at ``p95 >= enter_seconds``; stay until ``p95 <= exit_seconds``."""

    enter_seconds: float
    exit_seconds: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.exit_seconds < self.enter_seconds:
            raise ValueError(
                f"breaker threshold needs 0 <= exit_seconds < enter_seconds; "
                f"got exit {self.exit_seconds}, enter {self.enter_seconds}"
            )


@dataclass(slots=True, frozen=True)
class BreakerConfig:
    """Thresholds per signal and level; ``None`` leaves a signal out of a level."""

    queue_wait_shed_batch: Threshold | None = Threshold(2.0, 1.0)
    queue_wait_open: Threshold | None = Threshold(10.0, 5.0)
    step_shed_batch: Threshold | None = Threshold(0.5, 0.25)
    step_open: Threshold | None = Threshold(2.0, 1.0)
    percentile: float = 0.95
    window_seconds: float = 30.0
    #: Fewer samples than this in the window: the signal reads as healthy.
    min_samples: int = 20
    #: Memory bound per signal; the oldest samples go first.
    max_samples: int = 2048
    min_dwell_seconds: float = 5.0
    #: The state is re-evaluated at most this often (reading it is then a field load).
    evaluate_interval_seconds: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile <= 1.0:
            raise ValueError(f"percentile must be in (0, 1]; got {self.percentile}")
        for shed, opened, name in (
            (self.queue_wait_shed_batch, self.queue_wait_open, "queue_wait"),
            (self.step_shed_batch, self.step_open, "step"),
        ):
            if (
                shed is not None
                and opened is not None
                and opened.enter_seconds < shed.enter_seconds
            ):
                raise ValueError(
                    f"{name}_open.enter_seconds ({opened.enter_seconds}) must be at least "
                    f"{name}_shed_batch.enter_seconds ({shed.enter_seconds})"
                )


class _SlidingWindow:
    """Timestamped samples of the last ``window_seconds`` (at most ``max_samples``)."""

    __slots__ = ("_samples", "window_seconds")

    def __init__(self, window_seconds: float, max_samples: int) -> None:
        self.window_seconds = window_seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))

    def percentile(self, now: float, fraction: float, min_samples: int) -> float | None:
        samples = self._samples
        cutoff = now - self.window_seconds
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if len(samples) < max(1, min_samples):
            return None
        values = sorted(v for _, v in samples)
        # Nearest rank: the smallest value with at least ``fraction`` of samples at or below.
        return values[max(0, math.ceil(fraction * len(values)) - 1)]


@dataclass(slots=True, frozen=True)
class BreakerSnapshot:
    state: BreakerState
    p95_queue_wait_seconds: float | None
    p95_step_seconds: float | None
    seconds_in_state: float


class CircuitBreaker:
    """See the module docstring.  Not thread-safe: the event loop owns it.

    Feed it with :meth:`record_queue_wait` (as requests leave the queue) and
    :meth:`record_step` (per engine step); read :attr:`state` on every admission.
    """

    def __init__(
        self,
        config: BreakerConfig | None = None,
        clock: Clock = time.monotonic,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._on_transition = on_transition
        self._queue_wait = _SlidingWindow(self.config.window_seconds, self.config.max_samples)
        self._step = _SlidingWindow(self.config.window_seconds, self.config.max_samples)
        now = clock()
        self._state = BreakerState.CLOSED
        self._entered_at = now
        self._evaluated_at = -math.inf

    def record_queue_wait(self, seconds: float) -> None:
        self._queue_wait.add(self._clock(), seconds)

    def record_step(self, seconds: float) -> None:
        self._step.add(self._clock(), seconds)

    @property
    def state(self) -> BreakerState:
        """The current state, re-evaluated if ``evaluate_interval_seconds`` have passed."""
        if self._clock() - self._evaluated_at >= self.config.evaluate_interval_seconds:
            return self.evaluate()
        return self._state

    @property
    def retry_after_seconds(self) -> float:
        """Earliest time the breaker could relax a level (0 when closed)."""
        if self._state is BreakerState.CLOSED:
            return 0.0
        remaining_dwell = self.config.min_dwell_seconds - (self._clock() - self._entered_at)
        return max(remaining_dwell, self.config.evaluate_interval_seconds, 1.0)

    def evaluate(self) -> BreakerState:
        """Recompute the state from the windows now."""
        now = self._clock()
        self._evaluated_at = now
        cfg = self.config
        queue_wait = self._queue_wait.percentile(now, cfg.percentile, cfg.min_samples)
        step = self._step.percentile(now, cfg.percentile, cfg.min_samples)
        current = self._state
        entered = self._level(queue_wait, step, entering=True)
        if entered > current:
            self._transition(entered, now)
        elif current > BreakerState.CLOSED and now - self._entered_at >= cfg.min_dwell_seconds:
            held = self._level(queue_wait, step, entering=False)
            if held < current:
                self._transition(BreakerState(current - 1), now)
        return self._state

    def snapshot(self) -> BreakerSnapshot:
        now = self._clock()
        cfg = self.config
        return BreakerSnapshot(
            state=self.state,
            p95_queue_wait_seconds=self._queue_wait.percentile(
                now, cfg.percentile, cfg.min_samples
            ),
            p95_step_seconds=self._step.percentile(now, cfg.percentile, cfg.min_samples),
            seconds_in_state=now - self._entered_at,
        )

    def _level(
        self, queue_wait: float | None, step: float | None, *, entering: bool
    ) -> BreakerState:
        """Highest level whose enter (or, for staying, exit) threshold a signal crosses."""
        cfg = self.config
        level = BreakerState.CLOSED
        for candidate, queue_threshold, step_threshold in (
            (BreakerState.SHED_BATCH, cfg.queue_wait_shed_batch, cfg.step_shed_batch),
            (BreakerState.OPEN, cfg.queue_wait_open, cfg.step_open),
        ):
            if _crosses(queue_wait, queue_threshold, entering) or _crosses(
                step, step_threshold, entering
            ):
                level = candidate
        return level

    def _transition(self, new_state: BreakerState, now: float) -> None:
        old_state = self._state
        self._state = new_state
        self._entered_at = now
        if self._on_transition is not None:
            self._on_transition(old_state, new_state)


def _crosses(value: float | None, threshold: Threshold | None, entering: bool) -> bool:
    if value is None or threshold is None:
        return False
    if entering:
        return value >= threshold.enter_seconds
    return value > threshold.exit_seconds
