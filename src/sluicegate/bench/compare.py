"""Side by side: our server under two (or more) configurations, the same seeded load.

Each configuration gets its own server process (``python -m sluicegate serve --config
X.yaml`` on a free port), started, driven with the scenario's schedule, and stopped
before the next starts: the configurations run *in turn*, never at once, so they do not
share the machine.  When the scenario's rates are multiples of capacity and none is
given, the capacity is measured on the first configuration and used for all of them,
so every configuration is offered exactly the same requests at the same times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from sluicegate.bench.capacity import CapacityResult, Trial, find_capacity
from sluicegate.bench.client import Target
from sluicegate.bench.plots import plot_capacity, write_plots
from sluicegate.bench.results_file import write_results
from sluicegate.bench.runner import Runner, RunResult
from sluicegate.bench.scenario import Scenario
from sluicegate.bench.schedule import build_schedule
from sluicegate.bench.server_process import server_settings, start_server
from sluicegate.bench.stats import GroupStats
from sluicegate.bench.summary import write_summary


@dataclass(slots=True)
class Outputs:
    """The files a command wrote."""

    results_json: Path
    summary_md: Path
    plots: list[Path] = field(default_factory=list)


def write_outputs(
    out_dir: Path, results: Sequence[RunResult], capacity: CapacityResult | None = None
) -> Outputs:
    """``results.json``, PNG plots, and ``summary.md`` (which links the plots)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out_dir) if results else []
    if capacity is not None and capacity.trials:
        plots.append(plot_capacity(capacity, out_dir / "capacity.png"))
    return Outputs(
        write_results(out_dir, results, capacity),
        write_summary(out_dir, results, capacity, plots),
        plots,
    )


def config_labels(paths: Sequence[Path]) -> list[str]:
    """A short, unique label per config file: its stem (``A.yaml`` is ``A``)."""
    labels: list[str] = []
    for path in paths:
        label = path.stem
        if label in labels:
            label = f"{label}-{len(labels) + 1}"
        labels.append(label)
    return labels


def trial_line(trial: Trial) -> str:
    verdict = "sustainable" if trial.sustainable else "NOT sustainable: " + "; ".join(trial.reasons)
    p90 = "-" if trial.ttft_p90_seconds is None else f"{trial.ttft_p90_seconds * 1000:.0f} ms"
    return (
        f"  trial {trial.index + 1}: {trial.rate_rps:.3g} req/s, {trial.num_requests} requests, "
        f"TTFT p90 {p90}, growth {trial.ttft_growth_seconds_per_second:+.3f} s/s -> {verdict}"
    )


def measure_capacity(runner: Runner, console: Console) -> CapacityResult:
    """The capacity search on ``runner``'s target, each trial and the result printed."""
    capacity = find_capacity(
        runner, on_trial=lambda t: console.print(trial_line(t), highlight=False)
    )
    console.print(f"  capacity: {capacity.capacity_rps:.2f} req/s {capacity.note}")
    return capacity


def headline_line(label: str, stats: GroupStats) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    ttft, tpot = stats.ttft, stats.tpot
    return (
        f"{label}: {stats.num_planned} requests, {stats.num_completed} completed, "
        f"{stats.rejection_rate:.1%} rejected; TTFT p50 {ms(ttft.p50 if ttft else None)} "
        f"p90 {ms(ttft.p90 if ttft else None)} p99 {ms(ttft.p99 if ttft else None)}; "
        f"TPOT p50 {ms(tpot.p50 if tpot else None)} p99 {ms(tpot.p99 if tpot else None)}; "
        f"goodput {stats.goodput_rps:.2f} req/s ({stats.goodput_fraction:.0%}); "
        f"{stats.output_tokens_per_second:.0f} tokens/s; QoE {stats.qoe_mean or 0:.2f}"
        + (
            ""
            if stats.qoe_admitted_mean is None
            else f" (admitted {stats.qoe_admitted_mean:.2f}, "
            f"{stats.qoe_admitted_full_fraction or 0:.0%} of them at 1.0)"
        )
        + (
            f"; {stats.num_past_objective} of {stats.num_promised_ttft} admitted past the "
            "server's own TTFT objective"
            if stats.num_promised_ttft
            else ""
        )
    )


def run_compare(
    scenario: Scenario,
    config_paths: Sequence[Path],
    out_dir: Path,
    *,
    duration_seconds: float | None = None,
    capacity_rps: float | None = None,
    seed: int | None = None,
    console: Console | None = None,
    show_progress: bool = True,
    ready_timeout_seconds: float = 180.0,
) -> tuple[list[RunResult], CapacityResult | None, Outputs]:
    """Run the scenario against each configuration in turn; write every output."""
    console = console or Console(stderr=True)
    labels = config_labels(config_paths)
    results: list[RunResult] = []
    capacity: CapacityResult | None = None
    total = len(config_paths)
    for number, (label, path) in enumerate(zip(labels, config_paths, strict=True), start=1):
        console.print(
            f"[bold]\\[{number}/{total}] configuration {label}[/bold] ({path}): starting the server"
        )
        settings = server_settings(path)
        with start_server(
            path, out_dir / f"server-{label}.log", ready_timeout_seconds=ready_timeout_seconds
        ) as server:
            console.print(f"  ready on {server.base_url}; settings {settings}")
            runner = Runner(
                Target.parse(server.base_url),
                scenario,
                console=console,
                show_progress=show_progress,
            )
            if scenario.needs_capacity and capacity_rps is None:
                console.print(f"  measuring capacity on {label} (used for every configuration)")
                capacity = measure_capacity(runner, console)
                capacity_rps = capacity.capacity_rps
            schedule = build_schedule(
                scenario, seed=seed, capacity_rps=capacity_rps, duration_seconds=duration_seconds
            )
            console.print(
                f"  driving {label} with {len(schedule.requests)} requests over "
                f"{schedule.arrival_window_seconds:.1f}s (seed {schedule.seed})"
            )
            result = runner.run(schedule, label, capacity_rps=capacity_rps)
            result.server_config = {"path": str(path), "settings": settings}
            results.append(result)
        console.print("  " + headline_line(label, result.summary()["all"]), highlight=False)
    outputs = write_outputs(out_dir, results, capacity)
    return results, capacity, outputs
