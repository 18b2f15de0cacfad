"""``sluicegate bench soak``: did the server's resident memory stay flat under a long run
of mixed traffic (normal clients, slow readers, disconnects, tenants)?

The run's ``/metrics`` scrapes give ``process_resident_memory_bytes`` over time.  The
first fifth of the run is warm-up (allocator pools, caches, the first of every kind of
request, and what the server keeps on purpose for a while: replay logs for
``replay_ttl_seconds``, latency windows); after it, the median of the first window is
compared with the median of the last, and a least-squares slope is fitted.  Memory is
*flat* when it grew by at most ``max(tolerance_fraction × start, min_tolerance_bytes)``
from one window to the other.
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

    @property
    def growth_bytes(self) -> float:
        return self.end_bytes - self.start_bytes

    @property
    def flat(self) -> bool:
        return self.growth_bytes <= self.tolerance_bytes

    def describe(self) -> str:
        verdict = "FLAT" if self.flat else "GREW"
        return (
            f"resident memory {verdict}: {format_memory_size(int(self.start_bytes))} after "
            f"{self.warmup_seconds:.0f}s of warm-up, {format_memory_size(int(self.end_bytes))} "
            f"at the end ({self.growth_bytes / 2**20:+.1f} MiB, tolerance "
            f"{self.tolerance_bytes / 2**20:.0f} MiB); peak "
            f"{format_memory_size(int(self.peak_bytes))}; slope "
            f"{self.slope_bytes_per_hour / 2**20:+.1f} MiB/hour over {self.num_samples} samples"
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
        }


def memory_trend(
    series: Sequence[SeriesPoint],
    *,
    warmup_fraction: float = WARMUP_FRACTION,
    window_fraction: float = WINDOW_FRACTION,
    tolerance_fraction: float = TOLERANCE_FRACTION,
    min_tolerance_bytes: float = MIN_TOLERANCE_BYTES,
) -> MemoryTrend | None:
    """The trend of ``series`` (None: too few memory samples to say)."""
    points = [
        (p.offset_seconds, p.resident_memory_bytes)
        for p in series
        if p.resident_memory_bytes is not None
    ]
    if len(points) < 10:
        return None
    end = points[-1][0]
    warmup_seconds = points[0][0] + (end - points[0][0]) * warmup_fraction
    settled = [(t, m) for t, m in points if t >= warmup_seconds]
    window = max(2, round(len(settled) * window_fraction))
    start = statistics.median(m for _, m in settled[:window])
    last = statistics.median(m for _, m in settled[-window:])
    times = [t for t, _ in settled]
    sizes = [m for _, m in settled]
    slope = statistics.linear_regression(times, sizes).slope if len(set(times)) > 1 else 0.0
    return MemoryTrend(
        num_samples=len(settled),
        warmup_seconds=warmup_seconds,
        start_bytes=start,
        end_bytes=last,
        peak_bytes=max(sizes),
        slope_bytes_per_hour=slope * 3600.0,
        tolerance_bytes=max(start * tolerance_fraction, min_tolerance_bytes),
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
