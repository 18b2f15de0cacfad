"""``bench idle``: warm answers, a quiet spell, the first answer after it (sim server)."""

from __future__ import annotations

from sluicegate.bench.idle import IdleRun, measure
from sluicegate.bench.server_process import ServerProcess


def test_the_first_answer_after_a_quiet_spell_is_timed_beside_warm_ones(
    sim_server: ServerProcess,
) -> None:
    run = measure(sim_server, idle_seconds=0.5, warm=3, after=2)
    assert len(run.warm_ttft) == 3 and len(run.after_ttft) == 2
    assert run.first_ttft > 0.0 and run.ratio > 0.0
    assert "after 0 s idle: first" in run.line() or "after 1 s idle: first" in run.line()


def test_the_line_says_the_ratio() -> None:
    run = IdleRun(600.0, [0.04, 0.05, 0.06], 0.055, [0.05])
    assert run.line() == (
        "warm TTFT median 50 ms (of 3); after 600 s idle: first 55 ms (1.10x), then 50 ms"
    )
