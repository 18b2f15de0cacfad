"""``bench compare``: two server configurations, in turn, the same seeded load."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from sluicegate.bench.cli import bench_app

pytestmark = pytest.mark.slow

SERVER = """
engine: sim
sim_step_base_ms: 3
sim_step_per_token_ms: 0.01
max_num_seqs: 8
high_water_tokens: 16
low_water_tokens: 4
socket_send_buffer_bytes: 4096
transport_write_buffer_bytes: 4096
"""

SCENARIO = """
name: tiny-compare
description: a second of mixed readers
endpoint: chat
seed: 5
arrival: {process: poisson}
stages:
  - {duration_seconds: 0.5, rate_rps: 12}
  - {duration_seconds: 0.5, rate_rps: 24}
prompt_tokens: {kind: uniform, min: 16, max: 48}
output_tokens: 48
slow_readers: {fraction: 0.2, tokens_per_second: 60}
disconnects: {fraction: 0.2, after_tokens: 4}
limits: {drain_timeout_seconds: 3}
"""


def test_compare_runs_both_configurations_in_turn(tmp_path: Path) -> None:
    on, off = tmp_path / "on.yaml", tmp_path / "off.yaml"
    on.write_text(SERVER)
    off.write_text(SERVER + "pause: false\n")
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_app,
        [
            "compare",
            str(on),
            str(off),
            "--scenario",
            str(scenario),
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "ran in turn: on then off" in result.output

    document = orjson.loads((out / "results.json").read_bytes())
    assert document["order"] == ["on", "off"]
    summary = document["summary"]
    for label in ("on", "off"):
        entry = summary[label]
        for key in (
            "ttft_p50_seconds",
            "ttft_p99_seconds",
            "tpot_p50_seconds",
            "tpot_p99_seconds",
            "goodput_rps",
            "rejection_rate",
        ):
            assert key in entry, key
        assert entry["num_requests"] > 5 and entry["ttft_p50_seconds"] > 0
        assert "class=slow" in entry["groups"] and "class=disconnect" in entry["groups"]
    configurations = document["configurations"]
    assert configurations[1]["server_config"]["settings"]["pause"] is False
    # The same seeded schedule at both.
    schedules = [
        [(s["scheduled_offset_seconds"], s["client_class"], s["max_tokens"]) for s in c["samples"]]
        for c in configurations
    ]
    assert schedules[0] == schedules[1]
    for configuration in configurations:
        assert configuration["series"], "no /metrics scrapes"
        assert configuration["samples"][0]["attempts"][0]["token_events"]

    markdown = (out / "summary.md").read_text()
    assert "| `on` |" in markdown and "| `off` |" in markdown
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "latency_vs_load.png" in pngs and "timeseries.png" in pngs
    assert all((out / name).stat().st_size > 1000 for name in pngs)
    assert (out / "server-on.log").exists() and (out / "server-off.log").exists()


def test_compare_needs_two_configs_and_a_valid_scenario(tmp_path: Path) -> None:
    config = tmp_path / "a.yaml"
    config.write_text(SERVER)
    result = CliRunner().invoke(bench_app, ["compare", str(config), "--scenario", "steady"])
    assert result.exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages: []\nprompt_tokens: 1\noutput_tokens: 1\n")
    result = CliRunner().invoke(
        bench_app, ["compare", str(config), str(config), "--scenario", str(bad)]
    )
    assert result.exit_code == 2
    assert "stages" in result.output
