"""``burst-retry`` end to end: a real server (the sim engine, admission by objective) is
offered 3x its capacity, then 0.5x; every refused client comes back once at exactly the
time it was told, and most of those are admitted.

The stages are scaled down to 6 s with ``--duration-seconds``; the capacity is given
(the sim's steps are timed by the clock, not the CPU, so it does not drift with load).
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

#: About what `bench capacity --scenario overload` measures on this server (4.4 req/s).
CAPACITY_RPS = 4.5


@pytest.fixture(scope="module")
def slo_server() -> Iterator[ServerProcess]:
    server = start_server(
        [
            "--engine",
            "sim",
            "--sim-step-base-ms",
            "20",
            "--sim-step-per-token-ms",
            "0.2",
            "--max-num-seqs",
            "8",
            "--admission",
            "slo",
        ],
        "bench-burst-retry",
    )
    yield server
    server.stop()


def test_retries_at_the_advertised_time_are_mostly_admitted(
    slo_server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "burst-retry"
    result = CliRunner().invoke(
        bench_app,
        [
            "run",
            "--target",
            slo_server.base_url,
            "--scenario",
            "burst-retry",
            "--capacity-rps",
            str(CAPACITY_RPS),
            "--duration-seconds",
            "6",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "retries at the advertised time admitted" in result.output

    document = orjson.loads((out / "results.json").read_bytes())
    summary = document["summary"]["target"]
    samples = document["configurations"][0]["samples"]
    refused = [s for s in samples if s["attempts"][0]["outcome"] == "rejected"]
    retried = [s for s in refused if len(s["attempts"]) == 2]
    assert len(refused) >= 10, summary
    # Every refusal said when to come back, and every client came back then.
    assert all(s["attempts"][0]["retry_after_seconds"] is not None for s in refused)
    assert {s["attempts"][0]["error_code"] for s in refused} == {"slo_unreachable"}
    assert len(retried) == len(refused)
    on_time = [s for s in retried if abs(s["retry_lateness_seconds"]) <= 0.05]
    assert len(on_time) >= 0.9 * len(retried)
    assert summary["num_retries_on_time"] == len(on_time)
    # Most of them were admitted.
    fraction = summary["retry_on_time_admitted_fraction"]
    assert fraction is not None and fraction >= 0.5, summary
    admitted = [s for s in on_time if s["attempts"][1]["status"] == 200]
    assert summary["num_retries_on_time"] and len(admitted) >= 0.5 * len(on_time)
    (check,) = summary["targets"]
    assert check["name"] == "retries at the advertised time admitted"
    assert check["value"] == pytest.approx(fraction)
    # Per stage: the burst (3x) is where the refusals are, and they are answered at once.
    burst, calm = summary["stages"]
    assert burst["capacity_multiplier"] == 3.0 and calm["capacity_multiplier"] == 0.5
    assert burst["num_rejected"] >= 10 and burst["refusal_p50_seconds"] < 0.5
    assert burst["resident_memory_max_bytes"] and calm["resident_memory_max_bytes"]
    markdown = (out / "summary.md").read_text()
    assert "## Targets" in markdown and "## Admission by stage" in markdown
