"""Per-stage figures that need more than the samples, and the targets a run should meet.

A stage's *resident memory* is the mean and the maximum of ``process_resident_memory_bytes``
scraped while it ran; its *goodput fraction of capacity* is its goodput (requests per
second meeting both objectives; refused ones count as misses) over the capacity the rates
were multiples of.  Stages are compared by offered rate: the *base* stage is the first at
the lowest rate, the *peak* stage the first at the highest (for ``overload``: 0.5x and 3x).

The targets a scenario sets (its ``targets:`` section) are checked against these and
against the per-stage :class:`~sluicegate.bench.stats.GroupStats`, one
:class:`TargetCheck` per target and configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sluicegate.bench.records import SeriesPoint
from sluicegate.bench.runner import RunResult
from sluicegate.bench.scenario import ServiceObjectives, Targets
from sluicegate.bench.schedule import StagePlan
from sluicegate.bench.stats import GroupStats


@dataclass(slots=True)
class StageFigures:
    """One stage's server-side figures and its goodput against capacity."""

    index: int
    offered_rps: float
    capacity_multiplier: float | None = None
    resident_memory_mean_bytes: float | None = None
    resident_memory_max_bytes: float | None = None
    concurrency_limit_mean: float | None = None
    goodput_capacity_fraction: float | None = None


@dataclass(slots=True)
class RunFigures:
    """Every stage's figures, and the peak stage against the base stage."""

    stages: list[StageFigures] = field(default_factory=list)
    base_stage: int | None = None
    peak_stage: int | None = None
    #: Admitted TTFT p99, peak stage over base stage.
    ttft_p99_ratio: float | None = None
    #: Maximum RSS, peak stage over base stage.
    resident_memory_ratio: float | None = None


@dataclass(slots=True)
class TargetCheck:
    """One target for one configuration: the value found and whether it met the goal."""

    name: str
    goal: str
    value: float | None
    shown: str
    #: None when the run has nothing to judge by (no refusals, no capacity, ...).
    met: bool | None


def stage_series(series: Sequence[SeriesPoint], stage: StagePlan) -> list[SeriesPoint]:
    """The scrapes taken while ``stage`` ran."""
    return [p for p in series if stage.start_seconds <= p.offset_seconds < stage.end_seconds]


def _mean_max(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None
    return float(np.mean(present)), max(present)


def base_and_peak(stages: Sequence[StagePlan]) -> tuple[int | None, int | None]:
    """The first stage at the lowest offered rate, and the first at the highest."""
    if not stages:
        return None, None
    base = min(stages, key=lambda s: (s.offered_rps, s.index))
    peak = max(stages, key=lambda s: (s.offered_rps, -s.index))
    return base.index, peak.index


def _ratio(top: float | None, bottom: float | None) -> float | None:
    if top is None or bottom is None or bottom <= 0:
        return None
    return top / bottom


def run_figures(
    stages: Sequence[StagePlan],
    groups: Mapping[str, GroupStats],
    series: Sequence[SeriesPoint],
    capacity_rps: float | None,
) -> RunFigures:
    """Per-stage resident memory and goodput against capacity; the peak against the base."""
    figures = RunFigures()
    for stage in stages:
        points = stage_series(series, stage)
        rss_mean, rss_max = _mean_max([p.resident_memory_bytes for p in points])
        limit_mean, _ = _mean_max([p.concurrency_limit for p in points])
        stats = groups.get(f"stage={stage.index}")
        goodput = None if stats is None else _ratio(stats.goodput_rps, capacity_rps)
        figures.stages.append(
            StageFigures(
                stage.index,
                stage.offered_rps,
                stage.capacity_multiplier,
                rss_mean,
                rss_max,
                limit_mean,
                goodput,
            )
        )
    figures.base_stage, figures.peak_stage = base_and_peak(stages)
    if figures.base_stage is None or figures.peak_stage is None:
        return figures
    base = groups.get(f"stage={figures.base_stage}")
    peak = groups.get(f"stage={figures.peak_stage}")
    if base is not None and peak is not None and base.admitted_ttft and peak.admitted_ttft:
        figures.ttft_p99_ratio = _ratio(peak.admitted_ttft.p99, base.admitted_ttft.p99)
    by_index = {f.index: f for f in figures.stages}
    figures.resident_memory_ratio = _ratio(
        by_index[figures.peak_stage].resident_memory_max_bytes,
        by_index[figures.base_stage].resident_memory_max_bytes,
    )
    return figures


def _stage_label(stages: Sequence[StageFigures], index: int | None) -> str:
    stage = next((s for s in stages if s.index == index), None)
    if stage is None:
        return "?"
    if stage.capacity_multiplier is not None:
        return f"{stage.capacity_multiplier:g}x"
    return f"{stage.offered_rps:.3g} req/s"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f} ms"


def _judge(value: float | None, ok: bool) -> bool | None:
    return None if value is None else ok


def check_targets(
    targets: Targets,
    slo: ServiceObjectives,
    groups: Mapping[str, GroupStats],
    figures: RunFigures,
) -> list[TargetCheck]:
    """Each target the scenario sets, judged on one configuration's run."""
    peak_name = _stage_label(figures.stages, figures.peak_stage)
    base_name = _stage_label(figures.stages, figures.base_stage)
    peak = groups.get(f"stage={figures.peak_stage}")
    peak_figures = next((s for s in figures.stages if s.index == figures.peak_stage), None)
    checks: list[TargetCheck] = []
    if targets.ttft_p99_ratio_max is not None:
        value = figures.ttft_p99_ratio
        goal = targets.ttft_p99_ratio_max
        checks.append(
            TargetCheck(
                f"admitted TTFT p99, {peak_name} / {base_name}",
                f"≤ {goal:g}",
                value,
                "–" if value is None else f"{value:.2f}",
                _judge(value, value is not None and value <= goal),
            )
        )
    if targets.tpot_p99_within_objective:
        value = peak.tpot.p99 if peak is not None and peak.tpot else None
        goal = slo.tpot_seconds
        checks.append(
            TargetCheck(
                f"admitted TPOT p99 at {peak_name}",
                f"≤ {goal * 1000:g} ms",
                value,
                _ms(value),
                _judge(value, value is not None and value <= goal),
            )
        )
    if targets.goodput_capacity_fraction_min is not None:
        value = None if peak_figures is None else peak_figures.goodput_capacity_fraction
        goal = targets.goodput_capacity_fraction_min
        rps = "" if peak is None else f" ({peak.goodput_rps:.2f} req/s)"
        checks.append(
            TargetCheck(
                f"goodput at {peak_name} / capacity",
                f"≥ {goal:.0%}",
                value,
                "–" if value is None else f"{value:.0%}{rps}",
                _judge(value, value is not None and value >= goal),
            )
        )
    if targets.refusal_p99_seconds_below is not None:
        refusals = peak.refusal_latency if peak is not None else None
        value = refusals.p99 if refusals is not None else None
        goal = targets.refusal_p99_seconds_below
        count = 0 if refusals is None else refusals.count
        checks.append(
            TargetCheck(
                f"refusal latency p99 at {peak_name}",
                f"< {goal * 1000:g} ms",
                value,
                "no refusals" if value is None else f"{_ms(value)} (of {count})",
                _judge(value, value is not None and value < goal),
            )
        )
    if targets.resident_memory_ratio_tolerance is not None:
        value = figures.resident_memory_ratio
        goal = targets.resident_memory_ratio_tolerance
        checks.append(
            TargetCheck(
                f"max RSS, {peak_name} / {base_name}",
                f"within ±{goal:.0%}",
                value,
                "–" if value is None else f"{value:.3f}",
                _judge(value, value is not None and abs(value - 1.0) <= goal),
            )
        )
    if targets.retry_admitted_fraction_min is not None:
        everything = groups.get("all")
        value = None if everything is None else everything.retry_on_time_admitted_fraction
        goal = targets.retry_admitted_fraction_min
        shown = "no retries"
        if everything is not None and value is not None:
            shown = (
                f"{value:.0%} ({everything.num_retries_on_time_admitted}"
                f"/{everything.num_retries_on_time})"
            )
        if everything is not None and everything.num_retries_unheld:
            shown += (
                f"; told no seat was held: {everything.num_retries_unheld}, of which "
                f"{everything.num_retries_unheld_admitted} admitted later"
            )
        checks.append(
            TargetCheck(
                "retries at the advertised time admitted (a seat held)",
                f"≥ {goal:.0%}",
                value,
                shown,
                _judge(value, value is not None and value >= goal),
            )
        )
    return checks


def figures_of(result: RunResult, groups: Mapping[str, GroupStats] | None = None) -> RunFigures:
    """:func:`run_figures` of one run."""
    groups = result.summary() if groups is None else groups
    return run_figures(result.stages, groups, result.series, result.capacity_rps)


def checks_of(
    result: RunResult, groups: Mapping[str, GroupStats] | None = None
) -> list[TargetCheck]:
    """:func:`check_targets` of one run (empty when its scenario sets no target)."""
    groups = result.summary() if groups is None else groups
    scenario = result.scenario
    return check_targets(scenario.targets, scenario.slo, groups, figures_of(result, groups))


def targets_markdown(results: Sequence[RunResult]) -> list[str]:
    """The targets table: a row per target, a column per configuration."""
    checks = [checks_of(r) for r in results]
    if not results or not checks[0]:
        return []
    header = ["target", "goal", *(f"`{r.label}`" for r in results)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row, first in enumerate(checks[0]):
        cells = [first.name, first.goal]
        for per_run in checks:
            check = per_run[row]
            verdict = {True: "met", False: "**missed**", None: "n/a"}[check.met]
            cells.append(f"{check.shown}: {verdict}")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]
