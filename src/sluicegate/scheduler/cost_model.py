"""A cost model of the engine: how long a step takes, from the shape of its batch.

``seconds = fixed + per_seq · sequences + per_token · batched tokens + per_context ·
context tokens + per_chunk · chunks + per_pair · chunk pairs``.  The context tokens are
what attention reads: each sequence's position after the step.  A chunk is a sequence
computing more than one position (a piece of a prompt, or drafts), which an engine runs
through its prefill path: on the CPU engine each costs ~10-20 ms of its own beside a
decode batch, and its attention compares each of its queries with every key before it
(its pairs: ``length × position``), so 16 tokens at position 1,900 cost far more than
16 at 0.  A stall-free chunk is sized by these terms.

Fitted by least squares of the relative error, with non-negative coefficients, over the
most recent steps, so it follows the engine as the machine's load changes; seeded at
start-up by a few warm-up steps of varied shapes, so it predicts before any request has
run.

Written on the engine thread (:meth:`StepCostModel.observe`), read anywhere: the fitted
coefficients are one immutable tuple, replaced whole.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from sluicegate.scheduler.step import StepPlan

#: Coefficients: (fixed, per sequence, per batched token, per context token, per chunk,
#: per chunk pair), in seconds.
Coefficients = tuple[float, float, float, float, float, float]
Features = tuple[float, float, float, float, float, float]

_NAMES = (
    "fixed_seconds",
    "per_seq_seconds",
    "per_token_seconds",
    "per_context_token_seconds",
    "per_chunk_seconds",
    "per_chunk_pair_seconds",
)


@dataclass(slots=True, frozen=True)
class StepShape:
    """The features of one step."""

    num_seqs: int
    num_batched_tokens: int
    num_context_tokens: int
    #: Sequences computing more than one position (prompt chunks, drafts).
    num_chunks: int = 0
    #: Their attention's query-key pairs: each chunk's length times its end position.
    num_chunk_pairs: int = 0

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        chunks = [s for s in plan.sequences if s.num_scheduled_tokens > 1]
        pairs = sum(
            s.num_scheduled_tokens * (s.start_position + s.num_scheduled_tokens) for s in chunks
        )
        return cls(
            len(plan.sequences),
            plan.num_batched_tokens,
            plan.num_context_tokens,
            len(chunks),
            pairs,
        )

    def features(self) -> Features:
        return (
            1.0,
            float(self.num_seqs),
            float(self.num_batched_tokens),
            float(self.num_context_tokens),
            float(self.num_chunks),
            float(self.num_chunk_pairs),
        )


def chunk_seconds(coefficients: Coefficients, start: int, num_tokens: int) -> float:
    """What a sequence computing ``num_tokens`` positions from ``start`` adds to a step."""
    _, per_seq, per_token, per_context, per_chunk, per_pair = coefficients
    end = start + num_tokens
    seconds = per_seq + per_token * num_tokens + per_context * end
    if num_tokens > 1:
        seconds += per_chunk + per_pair * num_tokens * end
    return seconds


def chunk_tokens(coefficients: Coefficients, start: int, seconds: float) -> int:
    """The most positions from ``start`` a chunk can compute within ``seconds`` (0 when
    not even its own overhead fits; a large number when tokens cost nothing)."""
    _, per_seq, per_token, per_context, per_chunk, per_pair = coefficients
    # per_pair·n² + (per_token + per_context + per_pair·start)·n + overhead ≤ seconds
    a = per_pair
    b = per_token + per_context + per_pair * start
    c = per_seq + per_chunk + per_context * start - seconds
    if c > 0.0:
        return 0
    if a <= 0.0:
        return 1 << 30 if b <= 0.0 else int(-c / b)
    return int((-b + math.sqrt(b * b - 4.0 * a * c)) / (2.0 * a))


class StepCostModel:
    """Step time as a linear function of the batch's shape, refitted as steps come in."""

    def __init__(self, window: int = 2048, refit_every: int = 32) -> None:
        self._window: deque[tuple[Features, float]] = deque(maxlen=window)
        #: Warm-up observations: kept, so the fit stays defined for shapes not seen lately.
        self._anchors: list[tuple[Features, float]] = []
        self._refit_every = refit_every
        self._since_fit = 0
        self._lock = threading.Lock()
        self.coefficients: Coefficients = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.num_observations = 0

    @property
    def calibrated(self) -> bool:
        return self.num_observations > 0

    def calibrate(self, observations: list[tuple[StepShape, float]]) -> None:
        """Seed the model with warm-up steps (kept as anchors of every later fit)."""
        with self._lock:
            self._anchors = [(shape.features(), seconds) for shape, seconds in observations]
            self.num_observations += len(observations)
            self._fit()

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step as it ran."""
        with self._lock:
            self._window.append((shape.features(), seconds))
            self.num_observations += 1
            self._since_fit += 1
            if self._since_fit >= self._refit_every:
                self._fit()

    def forget_steps(self, *, decode_anchors: bool) -> None:
        """Drop every step seen since the warm-up: the engine now computes otherwise (its
        compiled decode step's build ended: it has every thread again, and with
        ``decode_anchors`` it decodes through the compiled step, so the warm-up's
        decode-only anchors go too).  The coefficients stand until the next few steps refit
        them with the anchors left."""
        with self._lock:

            def prefill(row: tuple[Features, float]) -> bool:
                return row[0][2] != row[0][1]  # more batched tokens than sequences

            if decode_anchors:
                self._anchors = [r for r in self._anchors if prefill(r)]
            self._window.clear()
            self._since_fit = max(0, self._refit_every - 8)  # refit after 8 new steps

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape."""
        theta = self.coefficients
        x = shape.features()
        return sum(t * v for t, v in zip(theta, x, strict=True))

    def decode_step_seconds(self, num_seqs: int, mean_context_tokens: float) -> float:
        """A step in which ``num_seqs`` sequences decode one token each."""
        return self.predict(
            StepShape(num_seqs, num_seqs, int(num_seqs * max(1.0, mean_context_tokens)))
        )

    def snapshot(self) -> dict[str, float]:
        out = dict(zip(_NAMES, self.coefficients, strict=True))
        out["observations"] = float(self.num_observations)
        return out

    def _fit(self) -> None:
        self._since_fit = 0
        rows = [*self._anchors, *self._window]
        if not rows:
            return
        x = np.asarray([r[0] for r in rows], dtype=np.float64)
        y = np.asarray([r[1] for r in rows], dtype=np.float64)
        # Relative error, not absolute: a burst of long prefill steps (hundreds of ms)
        # would otherwise outweigh the decode steps (tens of ms) that the seat limit and
        # every TPOT prediction are made of, and drag their fit wherever it suits them.
        weight = 1.0 / np.maximum(y, 1e-4)
        theta = _nonnegative_least_squares(x * weight[:, None], y * weight)
        c = [float(v) for v in theta]
        self.coefficients = (c[0], c[1], c[2], c[3], c[4], c[5])


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0 (a small active-set loop).

    Columns are scaled to unit norm first, and a little ridge keeps collinear features
    (decode steps have as many batched tokens as sequences) from trading off wildly.
    """
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0.0] = 1.0
    xs = x / scale
    active = np.ones(x.shape[1], dtype=bool)
    theta = np.zeros(x.shape[1])
    ridge = 1e-6
    for _ in range(x.shape[1]):
        cols = np.flatnonzero(active)
        a = xs[:, cols]
        gram = a.T @ a + ridge * np.eye(len(cols))
        solution = np.linalg.solve(gram, a.T @ y)
        theta[:] = 0.0
        theta[cols] = solution
        negative = cols[solution < 0.0]
        if len(negative) == 0:
            break
        active[negative] = False
    result: np.ndarray = np.maximum(theta, 0.0) / scale
    return result
