"""The warm-up that seeds the cost model: every shape paid for once, then timed three
times on the engine's own clock; the median counts, so one disturbed step does not."""

from __future__ import annotations

from typing import cast

import pytest

from sluicegate.engine import calibrate
from sluicegate.engine.base import Engine
from sluicegate.scheduler.step import StepPlan


class ScriptedEngine:
    """A step takes 1 ms per batched token, on a fake clock; the first step of a shape
    takes a second more (one-off costs), and so does the step ``disturbed`` (0-based)."""

    def __init__(self, disturbed: int) -> None:
        self.now = 0.0
        self.steps: list[StepPlan] = []
        self.disturbed = disturbed
        self._seen: set[tuple[int, int]] = set()

    def clock(self) -> float:
        return self.now

    def step(self, plan: StepPlan) -> None:
        self.steps.append(plan)
        shape = (len(plan.sequences), plan.num_batched_tokens)
        self.now += 0.001 * plan.num_batched_tokens
        if shape not in self._seen or len(self.steps) - 1 == self.disturbed:
            self.now += 1.0
        self._seen.add(shape)


def test_medians_ignore_one_off_costs_and_a_disturbed_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ScriptedEngine(disturbed=12)  # a measured step of the first timed pass
    monkeypatch.setattr(calibrate.time, "perf_counter", engine.clock)
    observations = calibrate.warm_up(cast(Engine, engine), 16, 1024, 512)
    shapes = [shape for shape, _ in observations]
    assert len({(s.num_seqs, s.num_batched_tokens, s.num_context_tokens) for s in shapes}) == 9
    for shape, seconds in observations:
        assert seconds == pytest.approx(0.001 * shape.num_batched_tokens)
    # The largest step: 15 slots decoding at 512 positions beside a 497-token chunk.
    assert shapes[-1].num_seqs == 16 and shapes[-1].num_batched_tokens == 512
    # Each shape once unmeasured, three times measured, then every slot handed back.
    assert len(engine.steps) == 9 * 4 + 1
    assert engine.steps[-1].freed_kv_slots == list(range(16))
