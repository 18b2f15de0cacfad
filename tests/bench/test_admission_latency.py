from __future__ import annotations

from sluicegate.bench.admission_latency import measure_rejection_latency


def test_admission_latency_runs_every_path() -> None:
    # Behaviour only: the numbers themselves are for docs/benchmarks.md, not for tests.
    result = measure_rejection_latency(iterations=50, repeats=1)
    assert set(result.microseconds_by_path) == {
        "rejected: draining",
        "rejected: circuit_open (batch shed)",
        "rejected: rate_limited_requests",
        "rejected: rate_limited_tokens",
        "admitted + released",
    }
    assert all(us > 0 for us in result.microseconds_by_path.values())
    assert result.to_markdown().startswith("| path | µs per call |")
