"""Per-stage resident memory, goodput against capacity, and the targets table (pure)."""

from __future__ import annotations

import pytest

from sluicegate.bench.records import Attempt, Outcome, Sample, SeriesPoint
from sluicegate.bench.runner import Calibration, RunResult
from sluicegate.bench.scenario import ServiceObjectives, Targets, load_scenario
from sluicegate.bench.schedule import ClientClass, PlannedRequest, StagePlan
from sluicegate.bench.stats import GroupStats, Percentiles, summarise_run
from sluicegate.bench.targets import (
    base_and_peak,
    check_targets,
    checks_of,
    run_figures,
    stage_series,
    targets_markdown,
)

MiB = 2**20
SLO = ServiceObjectives(ttft_seconds=1.0, tpot_seconds=0.1)
#: The overload shape: 0.5x for 10 s, then 3x for 10 s, of a capacity of 2 req/s.
STAGES = [StagePlan(0, 1.0, 0.0, 10.0, 0.5), StagePlan(1, 6.0, 10.0, 20.0, 3.0)]


def rss_series(first_mib: float, second_mib: float) -> list[SeriesPoint]:
    """A scrape every half second; the concurrency limit drops from 8 to 4 in stage 1."""
    points = []
    for i in range(40):
        t = i * 0.5
        # Stage 0 settles at first_mib; stage 1 climbs to second_mib at its end.
        rss = first_mib if t < 10 else first_mib + (second_mib - first_mib) * (t - 10) / 9.5
        points.append(SeriesPoint(t, resident_memory_bytes=rss * MiB, concurrency_limit=8.0))
        if t >= 10:
            points[-1].concurrency_limit = 4.0
    return points


def test_resident_memory_per_stage_from_the_scraped_series() -> None:
    series = rss_series(100.0, 104.0)
    assert len(stage_series(series, STAGES[0])) == 20
    figures = run_figures(STAGES, {}, series, capacity_rps=2.0)
    first, second = figures.stages
    assert first.resident_memory_mean_bytes == pytest.approx(100 * MiB)
    assert first.resident_memory_max_bytes == pytest.approx(100 * MiB)
    assert second.resident_memory_mean_bytes == pytest.approx(102 * MiB)
    assert second.resident_memory_max_bytes == pytest.approx(104 * MiB)
    assert first.concurrency_limit_mean == 8.0 and second.concurrency_limit_mean == 4.0
    assert (figures.base_stage, figures.peak_stage) == (0, 1)
    assert figures.resident_memory_ratio == pytest.approx(1.04)
    # No scrapes (a target without /metrics): nothing to say.
    assert run_figures(STAGES, {}, [], 2.0).resident_memory_ratio is None


def test_base_is_the_lowest_rate_and_peak_the_highest_whatever_the_order() -> None:
    burst_then_calm = [StagePlan(0, 6.0, 0.0, 10.0, 3.0), StagePlan(1, 1.0, 10.0, 40.0, 0.5)]
    assert base_and_peak(burst_then_calm) == (1, 0)
    calm_burst_calm = [
        StagePlan(0, 1.0, 0.0, 10.0, 0.5),
        StagePlan(1, 6.0, 10.0, 20.0, 3.0),
        StagePlan(2, 1.0, 20.0, 30.0, 0.5),
    ]
    assert base_and_peak(calm_burst_calm) == (0, 1)
    assert base_and_peak([]) == (None, None)


def stage_stats(
    name: str,
    ttft_p99: float,
    tpot_p99: float | None,
    goodput_rps: float,
    refusal_p99: float | None,
) -> GroupStats:
    stats = GroupStats(name, 10.0, goodput_rps=goodput_rps)
    stats.admitted_ttft = Percentiles(10, ttft_p99 / 2, ttft_p99 / 2, ttft_p99, ttft_p99)
    stats.tpot = Percentiles() if tpot_p99 is None else Percentiles(10, p99=tpot_p99)
    count = 0 if refusal_p99 is None else 30
    stats.refusal_latency = Percentiles(count, p99=refusal_p99)
    return stats


ALL_TARGETS = Targets(
    ttft_p99_ratio_max=1.5,
    tpot_p99_within_objective=True,
    goodput_capacity_fraction_min=0.9,
    refusal_p99_seconds_below=0.010,
    resident_memory_ratio_tolerance=0.05,
    retry_admitted_fraction_min=0.8,
)


def test_every_target_is_judged() -> None:
    everything = GroupStats("all", 20.0, num_retries_on_time=10, num_retries_on_time_admitted=9)
    everything.retry_on_time_admitted_fraction = 0.9
    groups = {
        "all": everything,
        "stage=0": stage_stats("stage=0", 0.4, 0.03, 1.0, None),
        "stage=1": stage_stats("stage=1", 0.5, 0.05, 1.9, 0.004),
    }
    figures = run_figures(STAGES, groups, rss_series(100.0, 103.0), capacity_rps=2.0)
    checks = check_targets(ALL_TARGETS, SLO, groups, figures)
    assert [c.name for c in checks] == [
        "admitted TTFT p99, 3x / 0.5x",
        "admitted TPOT p99 at 3x",
        "goodput at 3x / capacity",
        "refusal latency p99 at 3x",
        "max RSS, 3x / 0.5x",
        "retries at the advertised time admitted (a seat held)",
    ]
    assert [c.value for c in checks] == pytest.approx([1.25, 0.05, 0.95, 0.004, 1.03, 0.9])
    assert all(c.met for c in checks)
    assert [c.shown for c in checks] == [
        "1.25",
        "50.0 ms",
        "95% (1.90 req/s)",
        "4.0 ms (of 30)",
        "1.030",
        "90% (9/10)",
    ]

    # A collapse: TTFT blows up, TPOT over the objective, goodput gone, RSS grows 20%,
    # retries refused again, and no fast refusals at all.
    everything.retry_on_time_admitted_fraction = 0.2
    groups["stage=1"] = stage_stats("stage=1", 30.0, 0.25, 0.2, None)
    figures = run_figures(STAGES, groups, rss_series(100.0, 120.0), capacity_rps=2.0)
    checks = check_targets(ALL_TARGETS, SLO, groups, figures)
    assert [c.met for c in checks] == [False, False, False, None, False, False]
    assert checks[3].shown == "no refusals"

    # Nothing set, nothing checked; no capacity, no goodput fraction to judge.
    assert check_targets(Targets(), SLO, groups, figures) == []
    no_capacity = run_figures(STAGES, groups, [], capacity_rps=None)
    only_goodput = Targets(goodput_capacity_fraction_min=0.9)
    assert check_targets(only_goodput, SLO, groups, no_capacity)[0].met is None


def planned(index: int, stage: StagePlan) -> PlannedRequest:
    return PlannedRequest(
        index=index,
        stage_index=stage.index,
        send_offset_seconds=stage.start_seconds + index % 10,
        tenant="default",
        client_class=ClientClass.NORMAL,
        target_prompt_tokens=100,
        max_tokens=64,
        disconnect_after_tokens=None,
        read_tokens_per_second=None,
        prompt_seed=index,
    )


def served(sent: float, ttft: float) -> Attempt:
    events = [(ttft + 0.02 * i, 1) for i in range(64)]
    return Attempt(
        sent,
        status=200,
        outcome=Outcome.COMPLETED,
        prompt_tokens=100,
        completion_tokens=64,
        token_events=events,
        e2e_seconds=events[-1][0],
    )


def run(label: str, overload_ttft: float, num_refused: int, rss_growth_mib: float) -> RunResult:
    """An overload run: 10 requests at 0.5x, 20 served and ``num_refused`` refused at 3x."""
    samples = [Sample(planned(i, STAGES[0]), [served(i, 0.2)]) for i in range(10)]
    for i in range(10, 30):
        samples.append(Sample(planned(i, STAGES[1]), [served(10.0 + i % 10, overload_ttft)]))
    for i in range(30, 30 + num_refused):
        refusal = Attempt(10.0, status=429, outcome=Outcome.REJECTED, e2e_seconds=0.003)
        samples.append(Sample(planned(i, STAGES[1]), [refusal]))
    return RunResult(
        label=label,
        target_url="http://127.0.0.1:1",
        scenario=load_scenario("overload"),
        seed=11,
        model="m",
        started_at_unix=0.0,
        capacity_rps=2.0,
        stages=STAGES,
        samples=samples,
        series=rss_series(100.0, 100.0 + rss_growth_mib),
        counters_before={},
        counters_after={},
        calibration=Calibration(1.0),
        wall_seconds=20.0,
    )


def test_targets_table_side_by_side() -> None:
    slo = run("slo", overload_ttft=0.25, num_refused=40, rss_growth_mib=1.0)
    static = run("static", overload_ttft=12.0, num_refused=0, rss_growth_mib=30.0)
    assert [c.met for c in checks_of(slo)] == [True, True, True, True, True]
    assert [c.met for c in checks_of(static)] == [False, True, False, None, False]
    lines = targets_markdown([slo, static])
    assert lines[0] == "| target | goal | `slo` | `static` |"
    assert lines[2] == "| admitted TTFT p99, 3x / 0.5x | ≤ 1.5 | 1.25: met | 60.00: **missed** |"
    assert lines[4].startswith("| goodput at 3x / capacity | ≥ 90% | 100% (2.00 req/s): met |")
    assert "no refusals: n/a" in lines[5]
    assert len(lines) == 2 + 5 + 1 and lines[-1] == ""
    # A scenario with no targets has no table.
    plain = run("plain", 0.25, 0, 0.0)
    plain.scenario = load_scenario("steady")
    assert targets_markdown([plain]) == []
    # The per-stage groups the table reads come from the run's own samples.
    groups = summarise_run(slo.samples, slo.stages, slo.scenario.slo)
    assert groups["stage=1"].num_rejected == 40 and groups["stage=1"].num_admitted == 20
