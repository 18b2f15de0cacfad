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
