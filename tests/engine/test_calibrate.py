"""The warm-up that seeds the cost model: every shape paid for once, then timed three
times on the engine's own clock; the median counts, so one disturbed step does not.  A
warm start reuses the saved calibration when the cheap shapes confirm it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from sluicegate.engine import calibrate
from sluicegate.engine.base import Engine
from sluicegate.scheduler.step import StepPlan


class ScriptedEngine:
    """A step takes 1 ms per batched token, on a fake clock; the first step of a shape
    takes a second more (one-off costs), and so does the step ``disturbed`` (0-based)."""

    def __init__(self, disturbed: int = -1, base: float = 0.0, per_token: float = 0.001) -> None:
        self.base = base
        self.per_token = per_token
        self.burst: range = range(0)
        self.now = 0.0
        self.steps: list[StepPlan] = []
        self.disturbed = disturbed
        self._seen: set[tuple[int, int]] = set()

    def clock(self) -> float:
        return self.now

    def step(self, plan: StepPlan) -> None:
        self.steps.append(plan)
        shape = (len(plan.sequences), plan.num_batched_tokens)
        if plan.sequences:
            self.now += self.base + self.per_token * plan.num_batched_tokens
        if len(self.steps) - 1 in self.burst and plan.num_batched_tokens == 1:
            self.now += 0.02  # other work on the machine slows the one-row steps
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


def saved_warm_up(
    monkeypatch: pytest.MonkeyPatch, engine: ScriptedEngine, path: Path, slots: int = 16
) -> list[tuple[int, int, int, float]]:
    monkeypatch.setattr(calibrate.time, "perf_counter", engine.clock)
    return rows(calibrate.warm_up(cast(Engine, engine), slots, 1024, 512, saved=path))


def rows(observations: calibrate.Observations) -> list[tuple[int, int, int, float]]:
    return [(s.num_seqs, s.num_batched_tokens, s.num_context_tokens, t) for s, t in observations]


@pytest.mark.parametrize(
    ("base", "per_token"),
    # SmolLM2-like step times, and a model whose every step takes over 0.1 s: what counts
    # as cheap scales with the model.
    [(0.01, 0.001), (0.2, 0.01)],
)
def test_a_warm_start_measures_only_the_cheap_shapes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, base: float, per_token: float
) -> None:
    path = tmp_path / "calibration" / "engine.json"
    first = saved_warm_up(monkeypatch, ScriptedEngine(base=base, per_token=per_token), path)
    assert [row[:4] for row in json.loads(path.read_text())["observations"]] == [
        list(row) for row in first
    ]
    again = ScriptedEngine(base=base, per_token=per_token)
    reused = saved_warm_up(monkeypatch, again, path)
    assert [row[:3] for row in reused] == [row[:3] for row in first]
    assert [t for *_, t in reused] == pytest.approx([t for *_, t in first])
    # Seven shapes of at most 0.1 s (six decode batches and the 64-token prompt), each
    # once unmeasured and three times measured; not the mixed and the full-batch step.
    assert len(again.steps) == 7 * 4 + 1
    assert max(p.num_batched_tokens for p in again.steps) == 64
    assert again.steps[-1].freed_kv_slots == list(range(16))


def test_a_machine_slower_alike_on_every_shape_scales_the_saved_calibration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    first = saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path)
    slower = ScriptedEngine(base=0.015, per_token=0.0015)
    reused = saved_warm_up(monkeypatch, slower, path)
    assert len(slower.steps) == 7 * 4 + 1
    assert [t for *_, t in reused] == pytest.approx([1.5 * t for *_, t in first])


def test_a_change_that_moves_shapes_unequally_measures_everything_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path)
    # Tokens cost twice as much, a step's fixed part the same: the 64-token prompt moves
    # by 1.9x, a one-token decode by 1.1x.  The saved full-batch step would be far off.
    changed = ScriptedEngine(base=0.01, per_token=0.002)
    measured = saved_warm_up(monkeypatch, changed, path)
    # The check twice, then the whole warm-up.
    assert len(changed.steps) == 2 * 7 * 4 + 9 * 4 + 1
    assert [t for *_, t in measured] == pytest.approx([0.01 + 0.002 * n for _, n, _, _ in measured])
    assert [row[:4] for row in json.loads(path.read_text())["observations"]] == [
        list(row) for row in measured
    ]


@pytest.mark.parametrize("saved", ["not json", '{"observations": [[1, 2]]}', "other shapes"])
def test_a_corrupt_or_foreign_file_measures_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, saved: str
) -> None:
    path = tmp_path / "engine.json"
    if saved == "other shapes":  # saved by an engine with fewer slots
        saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path, slots=8)
    else:
        path.write_text(saved)
    engine = ScriptedEngine(base=0.01)
    saved_warm_up(monkeypatch, engine, path)
    assert len(engine.steps) == 9 * 4 + 1


def test_a_check_disturbed_by_a_burst_of_other_work_gets_a_second_look(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    first = saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path)
    again = ScriptedEngine(base=0.01)
    again.burst = range(7 * 4)  # the whole first check: its one-row decodes 2.8x slower
    reused = saved_warm_up(monkeypatch, again, path)
    assert len(again.steps) == 2 * 7 * 4 + 1  # a second check, no full warm-up
    # The expensive shapes come from the file, the cheap ones from the check that agreed.
    assert [t for *_, t in reused] == pytest.approx([t for *_, t in first])


def test_when_every_shape_costs_alike_two_are_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A tiny model whose steps all cost their fixed part (the case a per-shape threshold
    missed: no shape was under it, and every start measured everything again)."""
    path = tmp_path / "engine.json"
    saved_warm_up(monkeypatch, ScriptedEngine(base=0.05, per_token=0.0), path)
    again = ScriptedEngine(base=0.05, per_token=0.0)
    saved_warm_up(monkeypatch, again, path)
    assert len(again.steps) == 2 * 4 + 1


def started(
    monkeypatch: pytest.MonkeyPatch, engine: ScriptedEngine, path: Path | None
) -> tuple[list[tuple[int, int, int, float]], calibrate.Remaining | None]:
    monkeypatch.setattr(calibrate.time, "perf_counter", engine.clock)
    first, remaining = calibrate.start_calibration(cast(Engine, engine), 16, 1024, 512, saved=path)
    return rows(first), remaining


def test_a_cold_start_serves_on_three_shapes_and_runs_the_warm_up_step_by_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    engine = ScriptedEngine(base=0.01)
    first, remaining = started(monkeypatch, engine, path)
    # Before serving: one decode of one sequence at the short context, sixteen at the
    # long one, and the 64-token prompt, each once unmeasured and once measured; the fit
    # starts from their times and a margin.
    assert [(s, n, c) for s, n, c, _ in first] == [(1, 1, 65), (16, 16, 8208), (1, 64, 64)]
    expected = [calibrate.COLD_CAUTION * (0.01 + 0.001 * n) for _, n, _, _ in first]
    assert [t for *_, t in first] == pytest.approx(expected)
    assert len(engine.steps) == 3 * 2 + 1 and not path.exists()
    assert remaining is not None and remaining.snapshot() == {
        "shapes_measured": 0,
        "shapes_left": 9,
    }
    steps = 0
    while not remaining.done:  # the engine thread's idle moments, one step each
        remaining.step(cast(Engine, engine), list(range(16)))
        steps += 1
    assert steps == 9 * 4  # every shape once unmeasured, three times measured
    assert engine.steps[-1].freed_kv_slots == list(range(16))
    # Then every shape, as the blocking warm-up gives them, and saved for the next start.
    whole = remaining.observations()
    blocking = saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), tmp_path / "x")
    assert [(s.num_seqs, s.num_batched_tokens, s.num_context_tokens) for s, _ in whole] == [
        row[:3] for row in blocking
    ]
    assert [t for _, t in whole] == pytest.approx([t for *_, t in blocking])
    assert [row[3] for row in json.loads(path.read_text())["observations"]] == [t for _, t in whole]


def test_a_warm_start_that_agrees_leaves_nothing_to_measure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    saved = saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path)
    again = ScriptedEngine(base=0.015, per_token=0.0015)  # 1.5x slower on every shape
    first, remaining = started(monkeypatch, again, path)
    assert remaining is None
    assert len(again.steps) == 3 * 2 + 1
    assert [t for *_, t in first] == pytest.approx([1.5 * t for *_, t in saved])


def test_a_warm_start_that_disagrees_scales_by_the_largest_move_until_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    saved = saved_warm_up(monkeypatch, ScriptedEngine(base=0.01), path)
    changed = ScriptedEngine(base=0.01, per_token=0.002)  # 64-token prompt 1.9x, decode 1.1x
    first, remaining = started(monkeypatch, changed, path)
    assert len(changed.steps) == 3 * 2 + 1
    largest = (0.01 + 0.002 * 64) / (0.01 + 0.001 * 64)
    # The three shapes as measured now, the others saved and scaled by the most any of
    # the three moved (an overestimate where a shape moved less: the safe side).
    measured = {(1, 1, 65), (16, 16, 8208), (1, 64, 64)}
    for (s, n, c, t), (*_, before) in zip(first, saved, strict=True):
        assert t == pytest.approx(0.01 + 0.002 * n if (s, n, c) in measured else before * largest)
    assert remaining is not None and remaining.snapshot()["shapes_left"] == 9
    while not remaining.done:
        remaining.step(cast(Engine, changed), list(range(16)))
    assert [t for _, t in remaining.observations()] == pytest.approx(
        [0.01 + 0.002 * n for _, n, _, _ in first]
    )


def test_the_steps_left_use_only_empty_slots_and_wait_for_enough_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ScriptedEngine(base=0.01)
    _, remaining = started(monkeypatch, engine, None)
    assert remaining is not None
    empty = [3, 5, 6, 7, 9]  # the others are held or cached
    assert remaining.fits(len(empty)) and not remaining.fits(0)
    before = len(engine.steps)
    while remaining.fits(len(empty)):
        remaining.step(cast(Engine, engine), empty)
    # The shapes of at most five sequences, in those slots only; the others wait.
    written = {seq.kv_slot for plan in engine.steps[before:] for seq in plan.sequences}
    assert written <= set(empty)
    assert [len(plan.sequences) for plan in remaining.plans] == [16, 16, 9, 16]
    assert not remaining.done and remaining.snapshot()["shapes_measured"] == 5
    # Given up there: the measured shapes and the first fit's others count.
    observations = dict(remaining.observations())
    assert len(observations) == 5 + 1  # the first fit's 16-sequence decode at 512
    remaining.release(cast(Engine, engine))
    assert engine.steps[-1].freed_kv_slots == sorted(written) == [3, 5, 6, 7]
