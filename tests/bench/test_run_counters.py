"""A bench run's own counts agree with the server's counters in ``/metrics``.

Overload a small server (4 slots, a queue of 4, policy reject, fixed limits) so that
some requests are refused with 429 and retried once after ``Retry-After``; some clients
leave after a few tokens, some read slowly.  Every attempt the bench made must show up
in the server's counters exactly once: admitted ones in ``requests_total`` (cancelled
ones as ``status="cancelled"``), refused ones in ``rejections_total``, and their prompt
tokens in ``prompt_tokens_total``.  The prompt-length calibration's requests count too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluicegate.bench.client import Target
from sluicegate.bench.records import Outcome
from sluicegate.bench.runner import Runner
from sluicegate.bench.scenario import load_scenario
from sluicegate.bench.schedule import ClientClass, build_schedule
from sluicegate.bench.scrape import MetricsSnapshot
from tests.support.servers import ServerProcess, start_server

pytestmark = pytest.mark.slow

SCENARIO = """
name: counters
endpoint: completions
seed: 21
arrival: {process: poisson}
stages: [{duration_seconds: 1.5, rate_rps: 40}]
prompt_tokens: {kind: uniform, min: 4, max: 40}
output_tokens: 120
slow_readers: {fraction: 0.1, tokens_per_second: 300}
disconnects: {fraction: 0.2, after_tokens: 3}
tenants:
  - {name: a, weight: 2, api_key: key-a}
  - {name: b, weight: 1, api_key: key-b}
retry_after: {retry_once: true, max_wait_seconds: 5}
limits: {drain_timeout_seconds: 15}
"""


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    server = start_server(
        [
            "--engine",
            "sim",
            "--sim-step-base-ms",
            "2",
            "--sim-step-per-token-ms",
            "0.01",
            "--max-num-seqs",
            "4",
            "--max-queued-requests",
            "4",
            "--queue-policy",
            "reject",
            # Fixed limits: every refusal is a 429 at the door.  Admission by objective
            # also tells a queued request whose deadline slipped (on a loaded machine) in
            # its stream, which the server counts as a request *and* a rejection, with
            # prompt tokens the bench never sees: not what these counts are about.
            "--admission",
            "static",
            # A disconnect cancels at once (no grace for a reconnect), so the bench's
            # "left" clients are exactly the server's cancellations.
            "--detached-grace-seconds",
            "0",
        ],
        "bench-counters",
    )
    yield server
    server.stop()


def test_counts_match_the_server_counters(small_server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "counters.yaml"
    path.write_text(SCENARIO)
    scenario = load_scenario(str(path))
    before = small_server.metrics()
    runner = Runner(Target.parse(small_server.base_url), scenario, show_progress=False)
    result = runner.run(build_schedule(scenario), "counters")

    attempts = [(s, a) for s in result.samples for a in s.attempts]
    rejected = [a for _, a in attempts if a.outcome is Outcome.REJECTED]
    admitted = [(s, a) for s, a in attempts if a.outcome is not Outcome.REJECTED]
    completed = [(s, a) for s, a in admitted if a.outcome is Outcome.COMPLETED]
    left = [(s, a) for s, a in admitted if a.outcome is Outcome.DISCONNECTED]
    outcomes = {a.outcome for _, a in attempts}
    assert outcomes <= {Outcome.COMPLETED, Outcome.DISCONNECTED, Outcome.REJECTED}, [
        a.error for _, a in attempts if a.error and a.outcome is not Outcome.REJECTED
    ]
    assert len(result.samples) >= 40 and rejected and completed and left
    assert all(a.retry_after_seconds is not None and a.refused_by_status for a in rejected)
    assert any(s.retry is not None for s in result.samples)
    assert all(a.completion_tokens == s.planned.max_tokens for s, a in completed)
    assert all(s.planned.client_class is ClientClass.DISCONNECT for s, _ in left)
    calibration = result.calibration
    assert calibration.measured and calibration.num_requests == 2

    def delta(after: MetricsSnapshot, name: str) -> float:
        return after.total(name) - before.total(name)

    # The server counts a cut stream when it notices the disconnect: let it settle (only a
    # server that never counts them takes this long).
    expected_requests = len(admitted) + calibration.num_requests
    deadline = time.monotonic() + 30
    after = small_server.metrics()
    while delta(after, "sluicegate_requests_total") < expected_requests:
        assert time.monotonic() < deadline, "the server never counted every request"
        time.sleep(0.1)
        after = small_server.metrics()

    assert delta(after, "sluicegate_requests_total") == expected_requests
    assert delta(after, "sluicegate_rejections_total") == len(rejected)
    assert delta(after, 'sluicegate_requests_total{status="cancelled"}') == len(left)
    assert delta(after, 'sluicegate_requests_total{status="length"}') == (
        len(completed) + calibration.num_requests
    )
    prompt_tokens = sum(a.prompt_tokens or 0 for _, a in admitted)
    assert all(a.prompt_tokens for _, a in admitted)
    assert delta(after, "sluicegate_prompt_tokens_total") == (
        prompt_tokens + calibration.prompt_tokens
    )
    # Completed streams: exactly what was generated.  A leaver's sequence was aborted
    # somewhere between what it received and its max_tokens.
    generated = delta(after, "sluicegate_generation_tokens_total")
    completed_tokens = sum(a.completion_tokens for _, a in completed)
    extra = generated - completed_tokens - calibration.completion_tokens
    assert sum(a.completion_tokens for _, a in left) <= extra
    assert extra <= sum(s.planned.max_tokens for s, _ in left)
    # The bench's own reconciliation (results.json server_counters, read after the
    # calibration) agrees.
    bench_delta = result.counters_delta
    assert bench_delta.get('sluicegate_requests_total{status="length"}') == len(completed)
    assert sum(v for k, v in bench_delta.items() if k.startswith("sluicegate_rejections")) == len(
        rejected
    )
