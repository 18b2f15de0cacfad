"""Write ``summary.md``: a run's report for people, with its targets, per configuration,
client class, tenant and stage, admission, server counters and plots (every raw figure is
in ``results.json``: :mod:`sluicegate.bench.results_file`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sluicegate.bench.capacity import CapacityResult
from sluicegate.bench.results_file import peak
from sluicegate.bench.runner import RunResult
from sluicegate.bench.stats import GroupStats
from sluicegate.bench.targets import figures_of, targets_markdown

SUMMARY_FILE = "summary.md"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _num(value: float | None, pattern: str = "{:.2f}") -> str:
    return "–" if value is None else pattern.format(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def summary_markdown(
    results: Sequence[RunResult],
    capacity: CapacityResult | None = None,
    plots: Sequence[Path] = (),
) -> str:
    """A human-readable report: headline table, groups, stages, server counters."""
    lines: list[str] = []
    if results:
        scenario = results[0].scenario
        lines += [f"# sluicegate bench: {scenario.name}", ""]
        if scenario.description:
            lines += [scenario.description.strip(), ""]
        order = " then ".join(f"`{r.label}`" for r in results)
        lines += [
            f"Seed {results[0].seed}; every configuration got the same seeded schedule, "
            f"in turn: {order}. Objectives: TTFT ≤ {scenario.slo.ttft_seconds:g} s, "
            f"TPOT ≤ {scenario.slo.tpot_seconds:g} s; QoE pace "
            f"{scenario.slo.qoe_tokens_per_second:g} tokens/s.",
            "",
        ]
    elif capacity is not None:
        lines += [
            f"# sluicegate bench capacity: {capacity.scenario_name}",
            "",
            f"Target {capacity.target_url}; each trial offers one rate with the scenario's "
            "arrival process and request mix.",
            "",
        ]
    if capacity is not None:
        lines += _capacity_lines(capacity)
    summaries = {r.label: r.summary() for r in results}
    targets = targets_markdown(results)
    if targets:
        lines += ["## Targets", "", *targets]
    if results:
        lines += ["## Per configuration", ""]
        rows = []
        for result in results:
            s = summaries[result.label]["all"]
            rss = peak(result, "resident_memory_bytes")
            rows.append(
                [
                    f"`{result.label}`",
                    str(s.num_planned),
                    str(s.num_completed),
                    _pct(s.rejection_rate),
                    _ms(s.ttft.p50 if s.ttft else None),
                    _ms(s.ttft.p99 if s.ttft else None),
                    _ms(s.tpot.p50 if s.tpot else None),
                    _ms(s.tpot.p99 if s.tpot else None),
                    _ms(s.itl.p99 if s.itl else None),
                    _ms(s.e2e.p99 if s.e2e else None),
                    _num(s.goodput_rps),
                    _pct(s.goodput_fraction),
                    _num(s.qoe_mean),
                    _pct(s.retry_success_rate),
                    _num(None if rss is None else rss / 2**20, "{:.0f} MiB"),
                    _num(peak(result, "requests_waiting"), "{:.0f}"),
                    _num(peak(result, "streams_paused"), "{:.0f}"),
                ]
            )
        lines += _table(
            [
                "configuration",
                "requests",
                "completed",
                "rejected",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "ITL p99",
                "e2e p99",
                "goodput req/s",
                "goodput",
                "QoE",
                "retry ok",
                "peak RSS",
                "peak queued",
                "peak paused",
            ],
            rows,
        )
        lines += ["## By client class and tenant", ""]
        rows = []
        for result in results:
            for name, s in summaries[result.label].items():
                if name == "all" or name.startswith("stage="):
                    continue
                rows.append(
                    [
                        f"`{result.label}`",
                        name,
                        str(s.num_planned),
                        _pct(s.rejection_rate),
                        _ms(s.ttft.p50 if s.ttft else None),
                        _ms(s.ttft.p99 if s.ttft else None),
                        _ms(s.tpot.p50 if s.tpot else None),
                        _ms(s.tpot.p99 if s.tpot else None),
                        _num(s.goodput_rps),
                        _pct(s.goodput_fraction),
                        _num(s.qoe_mean),
                    ]
                )
        lines += _table(
            [
                "configuration",
                "group",
                "requests",
                "rejected",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "goodput req/s",
                "goodput",
                "QoE",
            ],
            rows,
        )
        lines += ["## By stage (offered load)", ""]
        rows = []
        for result in results:
            for stage in result.stages:
                s = summaries[result.label][f"stage={stage.index}"]
                rows.append(
                    [
                        f"`{result.label}`",
                        str(stage.index),
                        _num(stage.offered_rps),
                        f"{stage.duration_seconds:.1f} s",
                        str(s.num_planned),
                        _ms(s.ttft.p50 if s.ttft else None),
                        _ms(s.ttft.p99 if s.ttft else None),
                        _ms(s.tpot.p99 if s.tpot else None),
                        _num(s.goodput_rps),
                        _pct(s.rejection_rate),
                    ]
                )
        lines += _table(
            [
                "configuration",
                "stage",
                "offered req/s",
                "length",
                "requests",
                "TTFT p50",
                "TTFT p99",
                "TPOT p99",
                "goodput req/s",
                "rejected",
            ],
            rows,
        )
        lines += _admission_lines(results, summaries)
        lines += _counter_lines(results)
        notes = [f"- `{r.label}`: {note}" for r in results for note in r.notes]
        notes += [
            f"- `{r.label}`: prompt calibration: {r.calibration.note}"
            for r in results
            if r.calibration.note
        ]
        if notes:
            lines += ["## Notes", "", *notes, ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        lines.append("")
    return "\n".join(lines)


def _capacity_lines(capacity: CapacityResult) -> list[str]:
    lines = [
        f"**Capacity: {capacity.capacity_rps:.2f} requests/s** (highest sustainable "
        f"{_num(capacity.sustainable_rps)}, lowest unsustainable "
        f"{_num(capacity.unsustainable_rps)}). {capacity.note}",
        "",
    ]
    rows = [
        [
            str(t.index + 1),
            _num(t.rate_rps),
            "yes" if t.sustainable else "no",
            str(t.num_requests),
            _ms(t.ttft_p90_seconds),
            _num(t.ttft_growth_seconds_per_second, "{:.3f}"),
            _pct(t.goodput_fraction),
            _pct(t.rejected_fraction),
            "; ".join(t.reasons) or "–",
        ]
        for t in capacity.trials
    ]
    return lines + _table(
        [
            "trial",
            "offered req/s",
            "sustainable",
            "requests",
            "TTFT p90",
            "TTFT growth s/s",
            "goodput",
            "rejected",
            "why not",
        ],
        rows,
    )


def _admission_lines(
    results: Sequence[RunResult], summaries: dict[str, dict[str, GroupStats]]
) -> list[str]:
    """Per stage: admitted-only latency, goodput against capacity, refusals, RSS, retries."""
    rows = []
    for result in results:
        groups = summaries[result.label]
        for figures in figures_of(result, groups).stages:
            s = groups[f"stage={figures.index}"]
            multiplier = figures.capacity_multiplier
            refusal = s.refusal_latency
            retries = "–"
            if s.num_retries_on_time:
                retries = (
                    f"{_pct(s.retry_on_time_admitted_fraction)} "
                    f"({s.num_retries_on_time_admitted}/{s.num_retries_on_time})"
                )
            rows.append(
                [
                    f"`{result.label}`",
                    str(figures.index),
                    "–" if multiplier is None else f"{multiplier:g}x",
                    _num(figures.offered_rps),
                    str(s.num_admitted),
                    f"{s.num_rejected} ({s.num_refused_in_stream})",
                    _ms(s.admitted_ttft.p50 if s.admitted_ttft else None),
                    _ms(s.admitted_ttft.p99 if s.admitted_ttft else None),
                    f"{s.num_past_objective}/{s.num_promised_ttft}" if s.num_promised_ttft else "–",
                    _ms(s.tpot.p99 if s.tpot else None),
                    _num(s.goodput_rps),
                    _pct(figures.goodput_capacity_fraction),
                    _ms3(refusal.p50 if refusal else None),
                    _ms3(refusal.p99 if refusal else None),
                    _mib(figures.resident_memory_mean_bytes),
                    _mib(figures.resident_memory_max_bytes),
                    _num(figures.concurrency_limit_mean, "{:.1f}"),
                    retries,
                ]
            )
    if not rows:
        return []
    header = [
        "configuration",
        "stage",
        "load",
        "offered req/s",
        "admitted",
        "refused (in stream)",
        "adm. TTFT p50",
        "adm. TTFT p99",
        "past own objective",
        "TPOT p99",
        "goodput req/s",
        "goodput / capacity",
        "refusal p50",
        "refusal p99",
        "RSS mean",
        "RSS max",
        "seat limit",
        "retries on time admitted",
    ]
    return [
        "## Admission by stage",
        "",
        "Admitted TTFT: first attempts the server took (one cut or failed before its first "
        "token counts with the time it waited). Past own objective: admitted attempts whose "
        "first token came after the objective the server admitted them to meet (its own "
        "measure, `usage.sluicegate`), of those it promised one. "
        "Refusal: sent to the complete 429/503. "
        "Seat limit: mean `sluicegate_concurrency_limit`. Retries on time: sent within "
        "the scenario's tolerance of the advertised time.",
        "",
        *_table(header, rows),
    ]


def _ms3(value: float | None) -> str:
    """Milliseconds with a decimal, for short times (refusals)."""
    return "–" if value is None else f"{value * 1000:.1f} ms"


def _mib(value: float | None) -> str:
    return _num(None if value is None else value / 2**20, "{:.0f} MiB")


def _counter_lines(results: Sequence[RunResult]) -> list[str]:
    names = sorted({k for r in results for k in r.counters_delta})
    if not names:
        return []
    header = ["server counter (delta)", *(f"`{r.label}`" for r in results)]
    rows = [
        [f"`{name}`", *(f"{r.counters_delta.get(name, 0.0):g}" for r in results)] for name in names
    ]
    return ["## Server counters over the run", "", *_table(header, rows)]


def write_summary(
    out_dir: Path,
    results: Sequence[RunResult],
    capacity: CapacityResult | None = None,
    plots: Sequence[Path] = (),
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SUMMARY_FILE
    path.write_text(summary_markdown(results, capacity, plots), encoding="utf-8")
    return path
