"""The engine's cost model: it recovers a known step-time law and follows a change."""

from __future__ import annotations

import random

import pytest

from sluicegate.scheduler.cost_model import StepCostModel, StepShape


def law(shape: StepShape) -> float:
    return (
        0.004
        + 0.0002 * shape.num_seqs
        + 0.00005 * shape.num_batched_tokens
        + (1e-7 * shape.num_context_tokens)
    )


def shapes(rng: random.Random, count: int) -> list[StepShape]:
    out = []
    for _ in range(count):
        seqs = rng.randint(1, 32)
        prefill = rng.choice([0, 0, 0, rng.randint(16, 400)])
        out.append(StepShape(seqs, seqs + prefill, seqs * rng.randint(32, 1500)))
    return out


def test_recovers_a_linear_step_time_from_observed_steps() -> None:
    rng = random.Random(0)
    model = StepCostModel(refit_every=8)
    assert not model.calibrated
    for shape in shapes(rng, 400):
        model.observe(shape, law(shape) * rng.uniform(0.97, 1.03))
    for shape in shapes(random.Random(1), 50):
        assert model.predict(shape) == pytest.approx(law(shape), rel=0.08)
    assert all(c >= 0.0 for c in model.coefficients)


def test_calibration_alone_predicts_and_coefficients_never_go_negative() -> None:
    model = StepCostModel()
    warm = [StepShape(n, n, n * 64) for n in (1, 2, 4, 16)] + [StepShape(1, 512, 512)]
    # A law with no per-context cost, and noise that would pull a free fit below zero.
    model.calibrate([(s, 0.01 + 0.0001 * s.num_batched_tokens) for s in warm])
    assert model.calibrated
    assert model.predict(StepShape(8, 8, 8 * 64)) == pytest.approx(0.0108, rel=0.05)
    assert min(model.coefficients) >= 0.0
    assert set(model.snapshot()) >= {"fixed_seconds", "observations"}


def test_the_fit_follows_the_engine_when_it_slows_down() -> None:
    rng = random.Random(2)
    model = StepCostModel(window=256, refit_every=16)
    for shape in shapes(rng, 300):
        model.observe(shape, law(shape))
    probe = StepShape(16, 16, 16 * 500)
    before = model.predict(probe)
    for shape in shapes(rng, 300):  # another process now shares the cores: 2x slower
        model.observe(shape, 2 * law(shape))
    assert model.predict(probe) == pytest.approx(2 * before, rel=0.1)


def test_long_prefill_steps_do_not_drag_the_decode_predictions() -> None:
    """Prefill attention grows with the square of a chunk, which the linear law lacks; a
    burst of such steps must not pull the decode steps' fit (they size the seats).  An
    absolute-error fit predicted 22 ms for the 36 ms decode step here."""
    model = StepCostModel()
    rng = random.Random(1)

    def decode(n: int) -> StepShape:
        return StepShape(n, n, n * 200)

    model.calibrate([(decode(n), 0.02 + 0.002 * n) for n in (1, 4, 8, 16, 32)])
    for i in range(512):
        n = 1 + i % 16
        model.observe(decode(n), 0.02 + 0.002 * n)
        if i % 2:  # a burst: every other step a prompt chunk of 50 to 500 tokens
            chunk = rng.randint(50, 500)
            seconds = 0.02 + 0.002 * n + 0.0005 * chunk + 3e-6 * chunk * chunk
            model.observe(StepShape(n + 1, n + chunk, n * 200 + chunk), seconds)
    assert model.predict(decode(8)) == pytest.approx(0.036, rel=0.1)
    assert model.predict(decode(16)) == pytest.approx(0.052, rel=0.1)


def test_decode_steps_are_relearnt_when_the_engine_computes_them_faster() -> None:
    """The compiled decode step comes into use: the decode steps seen before (warm-up
    anchors included) are forgotten and refitted from the next ones; prefill keeps its."""
    model = StepCostModel(refit_every=32)

    def decode(n: int) -> StepShape:
        return StepShape(n, n, n * 200)

    prefill = StepShape(1, 512, 512)
    model.calibrate([(decode(n), 0.03 + 0.002 * n) for n in (1, 4, 16)] + [(prefill, 0.5)])
    for n in range(1, 33):
        model.observe(decode(n), 0.03 + 0.002 * n)
    assert model.predict(decode(8)) == pytest.approx(0.046, rel=0.05)
    model.observe(prefill, 2.0)  # beside the build: slower, and forgotten with it
    model.forget_steps(decode_anchors=True)
    for n in (1, 4, 8, 16, 32, 2, 24, 12):  # the compiled step: half the time
        model.observe(decode(n), 0.015 + 0.001 * n)
    assert model.predict(decode(8)) == pytest.approx(0.023, rel=0.1)
    assert model.predict(prefill) == pytest.approx(0.5, rel=0.15)


def test_steps_beside_a_build_are_forgotten_when_it_ends() -> None:
    """A build that failed: every thread is back, decoding as before; the slow steps seen
    beside it go, the warm-up's anchors (decode ones included) stay."""
    model = StepCostModel(refit_every=32)

    def decode(n: int) -> StepShape:
        return StepShape(n, n, n * 200)

    model.calibrate([(decode(n), 0.03 + 0.002 * n) for n in (1, 4, 16)])
    for n in range(1, 65):  # one thread beside a compiler: three times slower
        model.observe(decode(n % 32 + 1), 3 * (0.03 + 0.002 * (n % 32 + 1)))
    assert model.predict(decode(8)) > 2 * 0.046  # the window outweighs the anchors
    model.forget_steps(decode_anchors=False)
    for n in (1, 4, 8, 16, 32, 2, 24, 12):
        model.observe(decode(n), 0.03 + 0.002 * n)
    assert model.predict(decode(8)) == pytest.approx(0.046, rel=0.05)
