"""``sluicegate bench soak``: did the server's resident memory stay flat under a long run
of mixed traffic (normal clients, slow readers, disconnects, tenants)?

The run's ``/metrics`` scrapes give ``process_resident_memory_bytes`` over time.  The
warm-up is the first fifth of the run, or the server's retention and a minute more if
that is longer (allocator pools, caches, the first of every kind of request, and what the
server keeps on purpose for a while: a finished stream's replay log for
``replay_ttl_seconds``, 300 s by default; memory rises for that long in any run, so a
slope taken before it has turned over says nothing of a leak).  After it, the median of
the first window is compared with the median of the last, and a least-squares slope is
fitted, per hour and per 10,000 operations (the requests sent after the warm-up).  Memory
is *flat* when it grew by at most ``max(tolerance_fraction × start, min_tolerance_bytes)``
from one window to the other and its slope is at most ``max_slope_per_10k_bytes``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluicegate.bench.records import SeriesPoint
from sluicegate.sizes import format_memory_size

WARMUP_FRACTION = 0.2
WINDOW_FRACTION = 0.1
TOLERANCE_FRACTION = 0.05
MIN_TOLERANCE_BYTES = 16 * 1024 * 1024
#: The server's default ``replay_ttl_seconds``.
RETENTION_SECONDS = 300.0
#: After the retention, the streams finished just before it expire too.
RETENTION_MARGIN_SECONDS = 60.0
#: Issue #31's bound on what 10,000 operations may leave behind after the warm-up.
MAX_SLOPE_PER_10K_BYTES = 5e6


@dataclass(slots=True, frozen=True)
class MemoryTrend:
    """Resident memory after warm-up: where it started and ended, its peak and slope."""

    num_samples: int
    warmup_seconds: float
    start_bytes: float
    end_bytes: float
    peak_bytes: float
    slope_bytes_per_hour: float
    tolerance_bytes: float
    #: Requests sent after the warm-up, and the slope per 10,000 of them (None: none).
    operations: int = 0
    slope_bytes_per_10k_operations: float | None = None
    max_slope_per_10k_bytes: float = MAX_SLOPE_PER_10K_BYTES

    @property
    def growth_bytes(self) -> float:
        return self.end_bytes - self.start_bytes

    @property
    def flat(self) -> bool:
        slope = self.slope_bytes_per_10k_operations
        steady = slope is None or slope <= self.max_slope_per_10k_bytes
        return self.growth_bytes <= self.tolerance_bytes and steady

    def describe(self) -> str:
        verdict = "FLAT" if self.flat else "GREW"
        return (
            f"resident memory {verdict}: {format_memory_size(int(self.start_bytes))} after "
            f"{self.warmup_seconds:.0f}s of warm-up, {format_memory_size(int(self.end_bytes))} "
            f"at the end ({self.growth_bytes / 2**20:+.1f} MiB, tolerance "
            f"{self.tolerance_bytes / 2**20:.0f} MiB); peak "
            f"{format_memory_size(int(self.peak_bytes))}; slope "
            f"{self.slope_bytes_per_hour / 2**20:+.1f} MiB/hour over {self.num_samples} samples"
            + self._per_operation()
        )

    def _per_operation(self) -> str:
        slope = self.slope_bytes_per_10k_operations
        if slope is None:
            return ""
        return (
            f", {slope / 1e6:+.2f} MB per 10k operations ({self.operations} after the "
            f"warm-up; at most {self.max_slope_per_10k_bytes / 1e6:g})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "flat": self.flat,
            "num_samples": self.num_samples,
            "warmup_seconds": self.warmup_seconds,
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "growth_bytes": self.growth_bytes,
            "peak_bytes": self.peak_bytes,
            "slope_bytes_per_hour": self.slope_bytes_per_hour,
            "tolerance_bytes": self.tolerance_bytes,
            "operations": self.operations,
            "slope_bytes_per_10k_operations": self.slope_bytes_per_10k_operations,
            "max_slope_per_10k_bytes": self.max_slope_per_10k_bytes,
        }


def memory_trend(
    series: Sequence[SeriesPoint],
    *,
    operation_offsets: Sequence[float] = (),
    retention_seconds: float = 0.0,
    warmup_fraction: float = WARMUP_FRACTION,
    window_fraction: float = WINDOW_FRACTION,
    tolerance_fraction: float = TOLERANCE_FRACTION,
    min_tolerance_bytes: float = MIN_TOLERANCE_BYTES,
    max_slope_per_10k_bytes: float = MAX_SLOPE_PER_10K_BYTES,
) -> MemoryTrend | None:
    """The trend of ``series`` (None: too few memory samples after the warm-up to say).

    ``operation_offsets``: when each request was sent (the series' clock);
    ``retention_seconds``: how long the server keeps finished work on purpose (0: no
    warm-up beyond ``warmup_fraction``)."""
    points = [
        (p.offset_seconds, p.resident_memory_bytes)
        for p in series
        if p.resident_memory_bytes is not None
    ]
    if len(points) < 10:
        return None
    end = points[-1][0]
    warmup_seconds = points[0][0] + (end - points[0][0]) * warmup_fraction
    if retention_seconds > 0:
        warmup_seconds = max(warmup_seconds, retention_seconds + RETENTION_MARGIN_SECONDS)
    settled = [(t, m) for t, m in points if t >= warmup_seconds]
    if len(settled) < 10:
        return None
    window = max(2, round(len(settled) * window_fraction))
    start = statistics.median(m for _, m in settled[:window])
    last = statistics.median(m for _, m in settled[-window:])
    times = [t for t, _ in settled]
    sizes = [m for _, m in settled]
    slope = statistics.linear_regression(times, sizes).slope if len(set(times)) > 1 else 0.0
    operations = sum(1 for t in operation_offsets if warmup_seconds <= t <= end)
    per_10k = None
    if operations and end > warmup_seconds:
        per_10k = slope / (operations / (end - warmup_seconds)) * 10_000
    return MemoryTrend(
        num_samples=len(settled),
        warmup_seconds=warmup_seconds,
        start_bytes=start,
        end_bytes=last,
        peak_bytes=max(sizes),
        slope_bytes_per_hour=slope * 3600.0,
        tolerance_bytes=max(start * tolerance_fraction, min_tolerance_bytes),
        operations=operations,
        slope_bytes_per_10k_operations=per_10k,
        max_slope_per_10k_bytes=max_slope_per_10k_bytes,
    )


def memory_section(trend: MemoryTrend | None, live_after: dict[str, float]) -> str:
    """The markdown appended to ``summary.md``."""
    lines = ["", "## Soak: memory and leftovers", ""]
    if trend is None:
        lines.append("Too few `process_resident_memory_bytes` samples to judge memory.")
    else:
        lines.append(f"**{trend.describe()}.**")
    if live_after:
        lines += ["", "After the run (all clients gone): "]
        lines.append(", ".join(f"`{name}` {value:g}" for name, value in live_after.items()))
    return "\n".join(lines) + "\n"
