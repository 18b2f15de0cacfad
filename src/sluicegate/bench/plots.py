"""PNG plots of one or more runs, every configuration on the same axes.

- ``latency_vs_load.png``: TTFT and TPOT percentiles, goodput and rejection rate
  against the offered load of each stage.
- ``timeseries.png``: requests waiting, paused streams, KV cache use, the seat limit and
  server RSS over the run (scraped from ``/metrics``).
- ``ttft_timeline.png``: every request's TTFT against its send time (queue growth).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from sluicegate.bench.capacity import CapacityResult
from sluicegate.bench.runner import RunResult

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
_STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def _color(index: int) -> str:
    return _COLORS[index % len(_COLORS)]


def plot_latency_vs_load(results: Sequence[RunResult], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ttft_ax, tpot_ax, good_ax = axes
    rej_ax = good_ax.twinx()
    for i, result in enumerate(results):
        groups = result.summary()
        stages = sorted(result.stages, key=lambda s: s.offered_rps)
        x = [s.offered_rps for s in stages]
        stats = [groups[f"stage={s.index}"] for s in stages]
        for q, style in _STYLES.items():
            ttft = [getattr(g.ttft, q) if g.ttft else None for g in stats]
            _line(ttft_ax, x, ttft, style, _color(i), f"{result.label} {q}", scale=1000)
            if q != "p90":
                tpot = [getattr(g.tpot, q) if g.tpot else None for g in stats]
                _line(tpot_ax, x, tpot, style, _color(i), f"{result.label} {q}", scale=1000)
        _line(good_ax, x, [g.goodput_rps for g in stats], "-", _color(i), f"{result.label} goodput")
        _line(
            rej_ax,
            x,
            [g.rejection_rate * 100 for g in stats],
            ":",
            _color(i),
            f"{result.label} rejected %",
        )
    ttft_ax.set(title="TTFT", xlabel="offered load (requests/s)", ylabel="ms")
    tpot_ax.set(title="TPOT", xlabel="offered load (requests/s)", ylabel="ms")
    good_ax.set(title="goodput and rejections", xlabel="offered load (requests/s)")
    good_ax.set_ylabel("goodput (requests/s)")
    rej_ax.set_ylabel("rejected (%)")
    for ax in (ttft_ax, tpot_ax):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    handles = good_ax.get_legend_handles_labels()
    extra = rej_ax.get_legend_handles_labels()
    good_ax.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=7)
    good_ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_timeseries(results: Sequence[RunResult], path: Path) -> Path:
    panels = (
        ("requests_waiting", "requests waiting (queue depth)", 1.0),
        ("streams_paused", "streams paused (slow readers)", 1.0),
        ("kv_cache_usage_ratio", "KV cache usage (%)", 100.0),
        ("concurrency_limit", "seat limit (concurrency_limit)", 1.0),
        ("resident_memory_bytes", "server RSS (MiB)", 1 / 2**20),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 12), sharex=True)
    for i, result in enumerate(results):
        for ax, (attribute, _, scale) in zip(axes, panels, strict=True):
            points = [(p.offset_seconds, getattr(p, attribute)) for p in result.series]
            points = [(t, v * scale) for t, v in points if v is not None]
            if points:
                ts, vs = zip(*points, strict=True)
                ax.plot(ts, vs, color=_color(i), label=result.label)
        if i == 0:
            for stage in result.stages[1:]:
                for ax in axes:
                    ax.axvline(stage.start_seconds, color="grey", alpha=0.4, linewidth=0.8)
    for ax, (_, title, _) in zip(axes, panels, strict=True):
        ax.set_ylim(bottom=0)
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the run started (grey lines: stage changes)")
    return _save(fig, path)


def plot_ttft_timeline(results: Sequence[RunResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, result in enumerate(results):
        points = [
            (a.sent_offset_seconds, a.ttft_seconds * 1000)
            for s in result.samples
            if (a := s.first) is not None and a.ttft_seconds is not None
        ]
        if points:
            ts, vs = zip(*points, strict=True)
            ax.scatter(ts, vs, s=6, alpha=0.6, color=_color(i), label=result.label)
        rejected = [a.sent_offset_seconds for s in result.samples if (a := s.first) and s.rejected]
        if rejected:
            ax.scatter(
                rejected,
                [0.0] * len(rejected),
                marker="x",
                s=12,
                color=_color(i),
                label=f"{result.label} rejected",
            )
    ax.set(title="TTFT of each request", xlabel="sent at (s)", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_capacity(capacity: CapacityResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for trial in capacity.trials:
        ax.scatter(
            trial.rate_rps,
            trial.ttft_growth_seconds_per_second,
            color="tab:green" if trial.sustainable else "tab:red",
        )
        ax.annotate(str(trial.index + 1), (trial.rate_rps, trial.ttft_growth_seconds_per_second))
    ax.axvline(capacity.capacity_rps, color="grey", linestyle="--", label="capacity")
    ax.set(
        title="capacity search (green: sustainable)",
        xlabel="offered load (requests/s)",
        ylabel="TTFT growth (s/s)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def write_plots(results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    """Every run plot, into ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_vs_load(results, out_dir / "latency_vs_load.png"),
        plot_timeseries(results, out_dir / "timeseries.png"),
        plot_ttft_timeline(results, out_dir / "ttft_timeline.png"),
    ]


def _line(
    ax: Axes,
    x: Sequence[float],
    y: Sequence[float | None],
    style: str,
    color: str,
    label: str,
    scale: float = 1.0,
) -> None:
    points = [(a, b * scale) for a, b in zip(x, y, strict=True) if b is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, linestyle=style, marker="o", markersize=3, color=color, label=label)


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
