"""``bench capacity``: the search for the knee, and the command around it.

The search (ramp, then bisect, judging each trial) is tested against a model of a
server whose capacity is known exactly: ``N`` seats, each request holding one for ``L``
steps of ``step`` seconds, so a saturated server completes ``N / (L * step)`` requests a
second.  Below that nothing queues; above it TTFT grows at ``rho - 1`` seconds per
second.  Time in the model is the schedule's, not the machine's: the knee it finds is
the same on any machine.

The command is run against a real server, on two trials whose verdicts do not depend on
how fast the machine is: far below the sim's capacity, and far above it (the sim's steps
take at least their nominal time, so its capacity is at most the model's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from sluicegate.bench.capacity import find_capacity
from sluicegate.bench.cli import bench_app
from sluicegate.bench.client import Target
from sluicegate.bench.records import Attempt, Outcome, Sample
from sluicegate.bench.scenario import Scenario, parse_scenario
from sluicegate.bench.schedule import Schedule
from tests.support.servers import ServerProcess, start_server

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
  trial_seconds: 20
  precision: 0.05
  max_trials: 12
"""


def step_seconds() -> float:
    return (STEP_BASE_MS + STEP_PER_TOKEN_MS * NUM_SEQS) / 1000.0


def analytic_capacity_rps() -> float:
    return NUM_SEQS / (OUTPUT_TOKENS * step_seconds())


def test_the_analytic_capacity() -> None:
    # 8 / (20 * 0.0208 s)
    assert analytic_capacity_rps() == pytest.approx(19.23, abs=0.01)


@dataclass
class _RunResult:
    samples: list[Sample]


class ModelRunner:
    """Plays a server of known capacity for :func:`find_capacity`: each planned request
    takes the seat that frees first, at its send time or when the seat frees, and holds
    it for its ``L`` steps (its first token after the first)."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.target = Target.parse("http://model.test:1")

    def run(
        self,
        schedule: Schedule,
        label: str,
        *,
        drain_timeout_seconds: float | None = None,
        settle_seconds: float = 1.0,
    ) -> _RunResult:
        step = step_seconds()
        seats = [0.0] * NUM_SEQS
        samples = []
        for planned in schedule.requests:
            sent = planned.send_offset_seconds
            seat = min(range(NUM_SEQS), key=seats.__getitem__)
            start = max(sent, seats[seat])
            seats[seat] = start + OUTPUT_TOKENS * step
            events = [(start - sent + (i + 1) * step, 1) for i in range(OUTPUT_TOKENS)]
            attempt = Attempt(
                sent,
                status=200,
                outcome=Outcome.COMPLETED,
                prompt_tokens=1,
                completion_tokens=OUTPUT_TOKENS,
                token_events=events,
                e2e_seconds=events[-1][0],
            )
            samples.append(Sample(planned, [attempt]))
        return _RunResult(samples)


@pytest.mark.parametrize("start_rps", [10.0, 40.0])
def test_the_search_finds_the_knee_from_below_and_from_above(start_rps: float) -> None:
    scenario = parse_scenario(SCENARIO)
    runner = ModelRunner(scenario)
    search = scenario.capacity.model_copy(update={"start_rps": start_rps})
    result = find_capacity(runner, search)  # type: ignore[arg-type]
    knee = analytic_capacity_rps()
    trials = "\n".join(
        f"{t.rate_rps:.2f} req/s: {t.sustainable} {t.reasons}" for t in result.trials
    )
    # Every trial is judged by what its samples show: sustainable below the knee (with
    # the few percent a 20 s trial cannot tell apart), not above it.
    for trial in result.trials:
        if trial.rate_rps < knee * 0.97:
            assert trial.sustainable, trials
        if trial.rate_rps > knee * 1.1:
            assert not trial.sustainable, trials
    # The knee is bracketed, within the precision asked for, and the capacity is the
    # middle of the bracket.
    assert result.sustainable_rps is not None and result.unsustainable_rps is not None, trials
    assert result.sustainable_rps < result.unsustainable_rps
    assert (result.unsustainable_rps - result.sustainable_rps) / result.sustainable_rps <= 0.05
    assert result.capacity_rps == pytest.approx(
        (result.sustainable_rps + result.unsustainable_rps) / 2
    )
    assert result.capacity_rps == pytest.approx(knee, rel=0.1), trials
    assert len(result.trials) <= search.max_trials and not result.note
    # From below it ramps up; from above, down; then it bisects.
    first, second = result.trials[:2]
    ratio = second.rate_rps / first.rate_rps
    assert ratio == pytest.approx(search.growth if first.sustainable else 1 / search.growth)


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


def test_the_capacity_command_brackets_the_knee_and_writes_its_report(
    capacity_server: ServerProcess, tmp_path: Path
) -> None:
    scenario = tmp_path / "capacity.yaml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "out"
    # Two trials of half a second: 4 req/s, a fifth of the capacity (sustainable on any
    # machine), then 40 req/s, twice the most the sim can serve (its steps never take
    # less than their nominal time): refused or queued without bound on any machine.
    result = CliRunner().invoke(
        bench_app,
        [
            "capacity",
            "--target",
            capacity_server.base_url,
            "--scenario",
            str(scenario),
            "--start-rps",
            "4",
            "--growth",
            "10",
            "--trial-seconds",
            "0.5",
            "--max-trials",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "capacity: 22.00 requests/s (sustainable 4.00, unsustainable 40.00)" in result.output
    document = orjson.loads((out / "results.json").read_bytes())
    capacity = document["capacity"]
    trials = "\n".join(
        f"{t['rate_rps']:.2f} req/s: {t['sustainable']} {t['reasons']}" for t in capacity["trials"]
    )
    assert [t["rate_rps"] for t in capacity["trials"]] == [4.0, 40.0], trials
    assert [t["sustainable"] for t in capacity["trials"]] == [True, False], trials
    assert capacity["trials"][1]["reasons"], trials
    assert capacity["sustainable_rps"] == 4.0 and capacity["unsustainable_rps"] == 40.0
    assert capacity["capacity_rps"] == pytest.approx(22.0)
    assert (out / "summary.md").read_text().count("| ") > 10
    assert (out / "capacity.png").stat().st_size > 1000
