"""Write ``results.json``: per configuration its headline figures, its groups and targets,
and every raw sample (``summary.md``, for people, is :mod:`sluicegate.bench.summary`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from sluicegate import __version__
from sluicegate.bench.capacity import CapacityResult
from sluicegate.bench.runner import RunResult
from sluicegate.bench.scenario import Scenario
from sluicegate.bench.stats import GroupStats, Percentiles
from sluicegate.bench.targets import checks_of, figures_of

RESULTS_FILE = "results.json"


def headline(stats: GroupStats) -> dict[str, Any]:
    """The per-configuration figures every comparison starts from."""

    def pct(name: str, q: str) -> float | None:
        dist = getattr(stats, name)
        return None if dist is None else getattr(dist, q)

    return {
        "num_requests": stats.num_planned,
        "num_completed": stats.num_completed,
        "num_rejected": stats.num_rejected,
        "num_errors": stats.num_errors + stats.num_aborted,
        "ttft_p50_seconds": pct("ttft", "p50"),
        "ttft_p90_seconds": pct("ttft", "p90"),
        "ttft_p99_seconds": pct("ttft", "p99"),
        "tpot_p50_seconds": pct("tpot", "p50"),
        "tpot_p99_seconds": pct("tpot", "p99"),
        "itl_p50_seconds": pct("itl", "p50"),
        "itl_p99_seconds": pct("itl", "p99"),
        "e2e_p50_seconds": pct("e2e", "p50"),
        "e2e_p99_seconds": pct("e2e", "p99"),
        "goodput_rps": stats.goodput_rps,
        "goodput_fraction": stats.goodput_fraction,
        "rejection_rate": stats.rejection_rate,
        "qoe_mean": stats.qoe_mean,
        "qoe_admitted_mean": stats.qoe_admitted_mean,
        "qoe_admitted_full_fraction": stats.qoe_admitted_full_fraction,
        "retry_success_rate": stats.retry_success_rate,
        "output_tokens_per_second": stats.output_tokens_per_second,
        "num_admitted": stats.num_admitted,
        "num_refused_in_stream": stats.num_refused_in_stream,
        "admitted_ttft_p50_seconds": pct("admitted_ttft", "p50"),
        "admitted_ttft_p99_seconds": pct("admitted_ttft", "p99"),
        "refusal_p50_seconds": pct("refusal_latency", "p50"),
        "refusal_p99_seconds": pct("refusal_latency", "p99"),
        "num_retries_on_time": stats.num_retries_on_time,
        "retry_on_time_admitted_fraction": stats.retry_on_time_admitted_fraction,
        "num_retries_unheld": stats.num_retries_unheld,
        "num_retries_unheld_admitted": stats.num_retries_unheld_admitted,
        "retry_lateness_p99_seconds": pct("retry_lateness", "p99"),
    }


def peak(result: RunResult, attribute: str) -> float | None:
    """The highest value of one of the run's series (``resident_memory_bytes``...), or None
    if the server never reported it."""
    values = [getattr(p, attribute) for p in result.series]
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summary_object(results: Sequence[RunResult]) -> dict[str, Any]:
    """``summary``: per configuration, the headline figures, peaks, and every group."""
    out: dict[str, Any] = {}
    for result in results:
        groups = result.summary()
        entry = headline(groups["all"])
        entry["peak_resident_memory_bytes"] = peak(result, "resident_memory_bytes")
        entry["peak_requests_waiting"] = peak(result, "requests_waiting")
        entry["peak_streams_paused"] = peak(result, "streams_paused")
        entry["peak_kv_cache_usage_ratio"] = peak(result, "kv_cache_usage_ratio")
        lateness = [x.send_lateness_seconds for x in result.samples if x.send_lateness_seconds]
        # Open-loop health: how late the generator sent, against the schedule.
        entry["send_lateness_p99_seconds"] = Percentiles.of(lateness).p99
        figures = figures_of(result, groups)
        capacity = result.capacity_rps
        entry["goodput_capacity_fraction"] = entry["goodput_rps"] / capacity if capacity else None
        entry["stages"] = [
            {**headline(groups[f"stage={f.index}"]), **dataclasses.asdict(f)}
            for f in figures.stages
        ]
        entry["base_stage"], entry["peak_stage"] = figures.base_stage, figures.peak_stage
        entry["ttft_p99_ratio"] = figures.ttft_p99_ratio
        entry["resident_memory_ratio"] = figures.resident_memory_ratio
        entry["targets"] = [dataclasses.asdict(c) for c in checks_of(result, groups)]
        entry["groups"] = {name: dataclasses.asdict(g) for name, g in groups.items()}
        out[result.label] = entry
    return out


def configuration_object(result: RunResult) -> dict[str, Any]:
    return {
        "label": result.label,
        "target": result.target_url,
        "server_config": result.server_config,
        "model": result.model,
        "seed": result.seed,
        "capacity_rps": result.capacity_rps,
        "started_at_unix": result.started_at_unix,
        "wall_seconds": result.wall_seconds,
        "interrupted": result.interrupted,
        "num_cut": result.num_cut,
        "notes": result.notes,
        "calibration": dataclasses.asdict(result.calibration),
        "stages": [
            {**dataclasses.asdict(s), "duration_seconds": s.duration_seconds} for s in result.stages
        ],
        "server_counters": {
            "before": result.counters_before,
            "after": result.counters_after,
            "delta": result.counters_delta,
        },
        "series": [p.to_json() for p in result.series],
        "samples": [s.to_json() for s in result.samples],
    }


def results_document(
    results: Sequence[RunResult], capacity: CapacityResult | None = None
) -> dict[str, Any]:
    scenario = results[0].scenario if results else None
    return {
        "tool": "sluicegate bench",
        "version": __version__,
        "command": " ".join(sys.argv),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "order": [r.label for r in results],
        "scenario": _scenario_json(scenario) if scenario else None,
        "capacity": dataclasses.asdict(capacity) if capacity else None,
        "summary": summary_object(results),
        "configurations": [configuration_object(r) for r in results],
    }


def _scenario_json(scenario: Scenario) -> dict[str, Any]:
    """The scenario as run, API keys redacted (results files get shared)."""
    data = scenario.model_dump(mode="json")
    for tenant in data["tenants"]:
        if tenant.get("api_key"):
            tenant["api_key"] = "***"
    return data


def write_results(
    out_dir: Path, results: Sequence[RunResult], capacity: CapacityResult | None = None
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    document = results_document(results, capacity)
    path.write_bytes(orjson.dumps(_finite(document), option=orjson.OPT_INDENT_2))
    return path


def _finite(value: Any) -> Any:
    """NaN and infinities are not JSON: write them as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
