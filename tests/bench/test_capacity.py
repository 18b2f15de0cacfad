"""``bench capacity`` finds the analytic capacity of the sim engine.

With ``max_num_seqs`` N slots, a decode step of N sequences takes
``base + per_token * N`` ms.  A request with a tiny prompt and ``L`` output tokens holds
its slot for L steps (its prefill step samples the first token, then L - 1 decode
steps), so a saturated server completes N requests every ``L * step(N)`` seconds:

    capacity = N / (L * step(N)) = 8 / (20 * 0.0208 s) = 19.2 requests/s.

(The front door hands a freed slot to the next request between steps, which costs a
little; the measured knee is a few percent lower.)  Constant arrivals make the knee
sharp: below capacity nothing queues, above it TTFT grows at ``rho - 1`` s/s.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from sluicegate.bench.cli import bench_app
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

NUM_SEQS = 8
STEP_BASE_MS = 20.0
STEP_PER_TOKEN_MS = 0.1
OUTPUT_TOKENS = 20

SCENARIO = f"""
name: capacity-simple
description: tiny prompts, fixed output length, constant arrivals
endpoint: completions
seed: 7
arrival: {{process: constant}}
stages: [{{duration_seconds: 2, rate_rps: 1}}]
prompt_tokens: 1
output_tokens: {OUTPUT_TOKENS}
tokens_per_word: 3
slo: {{ttft_seconds: 2.0, tpot_seconds: 0.5}}
capacity:
  start_rps: 10
  growth: 1.5
  trial_seconds: 1.2
  precision: 0.1
  max_trials: 8
"""


@pytest.fixture(scope="module")
def capacity_server() -> Iterator[ServerProcess]:
    server = start_server(
        [
            "--engine",
            "sim",
            "--sim-step-base-ms",
            str(STEP_BASE_MS),
            "--sim-step-per-token-ms",
            str(STEP_PER_TOKEN_MS),
            "--max-num-seqs",
            str(NUM_SEQS),
        ],
        "bench-capacity",
    )
    yield server
    server.stop()


def analytic_capacity_rps() -> float:
    step_seconds = (STEP_BASE_MS + STEP_PER_TOKEN_MS * NUM_SEQS) / 1000.0
    return NUM_SEQS / (OUTPUT_TOKENS * step_seconds)


def test_capacity_matches_the_step_time_model(
    capacity_server: ServerProcess, tmp_path: Path
) -> None:
    scenario = tmp_path / "capacity.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_app,
        [
            "capacity",
            "--target",
            capacity_server.base_url,
            "--scenario",
            str(scenario),
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "capacity:" in result.output and "requests/s" in result.output
    document = orjson.loads((out / "results.json").read_bytes())
    capacity = document["capacity"]
    expected = analytic_capacity_rps()
    assert expected == pytest.approx(19.23, abs=0.01)
    trials = "\n".join(
        f"{t['rate_rps']:.2f} req/s: {t['sustainable']} {t['reasons']}" for t in capacity["trials"]
    )
    assert capacity["capacity_rps"] == pytest.approx(expected, rel=0.15), trials
    # The knee is bracketed: a sustainable rate below it, an unsustainable one above.
    assert capacity["sustainable_rps"] < capacity["unsustainable_rps"]
    assert (out / "summary.md").read_text().count("| ") > 10
    assert (out / "capacity.png").stat().st_size > 1000
