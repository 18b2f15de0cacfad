"""Recent percentiles over a sliding time window, for /v1/stats and the dashboard.

Prometheus histograms answer "what were the percentiles" only through a query engine;
``/v1/stats`` answers a human with ``curl`` directly, from the last ``window_seconds``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class SlidingWindow:
    """Timestamped samples of the last ``window_seconds`` (at most ``max_samples``)."""

    def __init__(
        self,
        window_seconds: float = 60.0,
        max_samples: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_seconds = window_seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._clock = clock

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def mean(self) -> float | None:
        """The mean over the window (``None`` with no samples)."""
        self.percentiles()  # drops samples older than the window
        return sum(v for _, v in self._samples) / len(self._samples) if self._samples else None

    def percentiles(self, *fractions: float) -> dict[str, float | None]:
        """``{"p50": ..., "p99": ...}`` over the window (``None`` with no samples)."""
        horizon = self._clock() - self.window_seconds
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        out: dict[str, float | None] = {}
        for fraction in fractions:
            key = f"p{round(fraction * 100):d}"
            if not values:
                out[key] = None
                continue
            # Nearest rank: the smallest value with at least `fraction` of samples <= it.
            rank = min(len(values) - 1, max(0, math.ceil(fraction * len(values)) - 1))
            out[key] = values[rank]
        out["count"] = float(len(values))
        return out
