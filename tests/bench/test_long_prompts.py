"""``bench long-prompts``: one short phase against the shared sim server, and the table."""

from __future__ import annotations

import asyncio

from sluicegate.bench.long_prompts import (
    ConfigResult,
    Load,
    PhaseResult,
    percentile,
    prediction_errors,
    run_phase,
    table,
)
from sluicegate.bench.server_process import ServerProcess


def test_a_phase_measures_streams_probes_and_long_prompts(sim_server: ServerProcess) -> None:
    load = Load(
        streams=2,
        stream_tokens=24,
        probe_interval_seconds=0.3,
        long_interval_seconds=0.4,
        long_words=(40, 60),
    )
    result = asyncio.run(run_phase(sim_server.base_url, 4.0, load))
    assert result.gaps and result.probe_ttft
    assert result.long_ttft and result.long_prompt_tokens
    # Every admitted answer carries admission's prediction, and the error is computed.
    assert len(result.long_predicted) == len(result.long_ttft)
    assert all(e >= 0.0 for e in prediction_errors(result))
    assert result.streams_refused == 0
    assert result.stream_tokens >= len(result.gaps) and result.stream_tokens_per_second


def test_the_table_has_a_row_per_configuration_and_survives_empty_phases() -> None:
    quiet = PhaseResult(
        gaps=[0.04, 0.05, 0.06], probe_ttft=[0.1, 0.2], stream_tokens=40, seconds=20.0
    )
    loaded = PhaseResult(
        gaps=[0.05, 0.5], probe_ttft=[0.2, 0.4], long_ttft=[10.0], long_predicted=[8.0]
    )
    lines = table(
        [ConfigResult("stall-free", quiet, loaded, {}), ConfigResult("x", *[PhaseResult()] * 2, {})]
    )
    assert len(lines) == 4
    row = "| stall-free | 50 / 60 / 60 | 50 / 500 / 500 | 200 → 400 (2.00x) | 1, 0, 10.0 / 10.0 |"
    assert lines[2] == row + " 20% | 2.0 |"
    assert lines[3].startswith("| x | - / - / - |")
    assert percentile([], 0.5) is None and percentile([3.0, 1.0, 2.0], 0.5) == 2.0
