"""The soak's memory verdict: flat after warm-up, or grew."""

from __future__ import annotations

from sluicegate.bench.records import SeriesPoint
from sluicegate.bench.scenario import load_scenario
from sluicegate.bench.soak import memory_section, memory_trend

MIB = 2**20


def series(sizes: list[float]) -> list[SeriesPoint]:
    return [SeriesPoint(float(i), resident_memory_bytes=size) for i, size in enumerate(sizes)]


def test_warm_up_growth_then_a_plateau_is_flat() -> None:
    sizes = [100 * MIB + i * MIB for i in range(10)] + [
        110 * MIB + (i % 3) * MIB for i in range(90)
    ]
    trend = memory_trend(series(sizes))
    assert trend is not None and trend.flat, trend
    assert abs(trend.slope_bytes_per_hour) < 200 * MIB
    assert "FLAT" in trend.describe()


def test_steady_growth_is_not_flat() -> None:
    trend = memory_trend(series([200 * MIB + i * MIB for i in range(100)]))
    assert trend is not None and not trend.flat
    assert trend.growth_bytes > 50 * MIB and trend.slope_bytes_per_hour > 0
    assert "GREW" in memory_section(trend, {"sluicegate_requests_running": 0.0})


def test_too_few_samples_say_so() -> None:
    assert memory_trend(series([1.0, 2.0])) is None
    assert memory_trend([SeriesPoint(float(i)) for i in range(50)]) is None


def test_the_soak_scenario_mixes_every_kind_of_client() -> None:
    soak = load_scenario("soak")
    assert soak.total_stage_seconds == 600
    assert soak.slow_readers.fraction > 0 and soak.disconnects.fraction > 0
    assert len(soak.tenants) == 2 and not soak.needs_capacity


def test_the_slope_is_taken_after_the_retention_and_per_10k_operations() -> None:
    """Memory rises for the retention (300 samples of 1 s), then stays: flat, and the
    operations counted are the ones sent after the retention and its margin."""
    sizes = [100 * MIB + i * 0.1 * MIB for i in range(300)] + [130 * MIB] * 300
    sent = [i * 0.5 for i in range(1200)]  # 2 requests/s
    trend = memory_trend(series(sizes), operation_offsets=sent, retention_seconds=300)
    assert trend is not None and trend.flat, trend
    assert trend.warmup_seconds == 360
    assert trend.operations == sum(1 for t in sent if 360 <= t <= 599)
    assert trend.slope_bytes_per_10k_operations == 0
    # Without the retention the rise is taken for growth.
    early = memory_trend(series(sizes), operation_offsets=sent)
    assert early is not None and not early.flat


def test_a_slope_over_5_mb_per_10k_operations_is_growth_within_the_tolerance() -> None:
    # 1 KB more per request at 10 requests/s: 10 MB per 10k, 3 MB over the 300 s kept.
    sizes = [100 * MIB + i * 10_000 for i in range(600)]
    sent = [i * 0.1 for i in range(6000)]
    trend = memory_trend(series(sizes), operation_offsets=sent, retention_seconds=200)
    assert trend is not None and trend.growth_bytes < trend.tolerance_bytes
    assert trend.slope_bytes_per_10k_operations is not None
    assert abs(trend.slope_bytes_per_10k_operations - 10e6) < 0.1e6
    assert not trend.flat and "MB per 10k operations" in trend.describe()
