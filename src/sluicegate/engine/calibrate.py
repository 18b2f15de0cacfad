"""Warm-up steps that seed the scheduler's cost model before any request arrives.

A handful of steps of varied shapes (decode batches of growing size at two context
lengths, a prefill chunk, a mixed step, the largest step the scheduler can plan) on
placeholder tokens, each run once to pay its
one-off costs and then timed three times (the median counts): enough for a first fit,
which every real step then refines.  They write into KV
slots that no request holds yet, and the slots are handed back clean.

**A warm start reuses the last calibration.**  Given a file (the torch engine keeps one
per model file, dtype, thread count, torch build and CPU in its cache directory), the
warm-up saves its measurements there; the next start measures only the cheap shapes
(the cheapest, adding up to :data:`CHECK_SHARE` of a pass over all of them: on SmolLM2
the decode batches and the short prompt chunk, about a second, not the mixed and the
full-batch steps) and compares them with the saved ones (each shape's fastest step: noise only adds
time; a check that disagrees gets one more, :data:`CHECK_ATTEMPTS`).  If every cheap
shape moved by the same factor (within :data:`CHECK_SPREAD` of each other) the saved
measurements of the expensive shapes are reused, scaled by that
factor; if not (a busier machine that slows some shapes more than others, another engine
build, a corrupt file) the whole warm-up runs and its result replaces the file.  The
full-batch shape alone costs ~2.4 s of the ~4.5 s warm-up on SmolLM2, so this is most of
a warm start.

**Or serve first and finish in the background** (:func:`start_calibration`, what the
torch engine does): before serving, three cheap shapes are timed once each (the smallest
and the largest decode batch, the shortest prompt chunk: six steps).  A warm start whose
three shapes moved alike reuses the saved calibration scaled as they moved, as above; a
cold start fits on the three (times :data:`COLD_CAUTION`), and a warm start that does
not agree serves on the saved times scaled by the largest move; either way
:class:`Remaining` then runs the whole warm-up one step at a time while the engine has
no request, in slots that nothing holds (the prefix cache's are kept: a shape that needs
more waits for them, or from 20 s after the start empties cached ones, least recently
used first; what is not measured within two minutes is given up), and its fit replaces
the first.  A
machine busy with other work delays the start by six steps, not by a warm-up, and the
live fit refines the model from real steps meanwhile.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from sluicegate.engine.base import Engine
from sluicegate.engine.files import atomic_path
from sluicegate.scheduler.cost_model import StepShape
from sluicegate.scheduler.request import SamplingParams
from sluicegate.scheduler.step import ScheduledSequence, StepPlan

#: A token every vocabulary has (the sim's byte-level one included).
_TOKEN = 1
_SAMPLING = SamplingParams(max_tokens=1, seed=0, temperature=0.0)


logger = logging.getLogger(__name__)

#: A warm start measures the cheapest shapes whose saved steps add up to at most this share
#: of one pass over every shape (at least two: a share, so that the rule does not depend
#: on the model's size or the machine's speed, and holds when every shape costs alike).
CHECK_SHARE = 0.3
#: A warm start reuses the saved calibration only if its cheap shapes' ratios (measured
#: over saved) agree within this factor of each other: wide enough for this kind of shared
#: machine's noise, narrow enough to catch a per-token cost that moved apart from the
#: per-step one (the live fit corrects the rest within seconds of traffic).
CHECK_SPREAD = 1.5
#: Checks before a full warm-up (each adds its timings to the last: one slowed by a burst
#: of other work on the machine gets a second look).
CHECK_ATTEMPTS = 2

Observations = list[tuple[StepShape, float]]


def warm_up(
    engine: Engine,
    num_slots: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    repeats: int = 3,
    saved: Path | None = None,
) -> Observations:
    """Run the warm-up steps (every shape once unmeasured, then ``repeats`` times
    measured); returns each shape and the median of its measured seconds.  With ``saved``
    (a file), reuse the calibration saved there when the cheap shapes confirm it, and save
    a full warm-up's result there (see the module docstring)."""
    plans = _plans(num_slots, max_model_len, max_num_batched_tokens)
    observations = _reuse(engine, plans, repeats, saved) if saved is not None else None
    if observations is None:
        timings = _time(engine, plans, repeats)
        if saved is not None:
            _save(saved, timings)
        observations = _medians(timings)
    engine.step(StepPlan(freed_kv_slots=list(range(num_slots))))
    return observations


#: A cold start's first fit is made of single steps: its times are this much longer than
#: measured, on the safe side (fewer seats, later promises) until the full warm-up is in.
COLD_CAUTION = 1.25


def start_calibration(
    engine: Engine,
    num_slots: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    repeats: int = 3,
    saved: Path | None = None,
) -> tuple[Observations, Remaining | None]:
    """What the cost model starts from, measured now on three cheap shapes, and the warm-up
    left to run in the background (None: nothing; see the module docstring)."""
    plans = _plans(num_slots, max_model_len, max_num_batched_tokens)
    shapes = [_shape(plan) for plan in plans]
    now = dict(_medians(_time(engine, _first_plans(plans), repeats=1)))
    engine.step(StepPlan(freed_kv_slots=list(range(num_slots))))
    before = _read_saved(saved, shapes) if saved is not None else None
    if before is None:
        logger.info(
            "serving on a first fit of %d shapes, each timed once; the warm-up runs while "
            "the engine is idle",
            len(now),
        )
        first = [(shape, seconds * COLD_CAUTION) for shape, seconds in now.items()]
        return first, Remaining(list(plans), repeats, [], shapes, saved, first)
    moved = {shape: seconds / before[shape][1] for shape, seconds in now.items()}
    low, high = min(moved.values()), max(moved.values())
    if _agreed(moved):
        factor = statistics.median(moved.values())
        logger.info("saved calibration reused, scaled by %.2f (%.2f-%.2fx)", factor, low, high)
        return [(s, now.get(s, before[s][0] * factor)) for s in shapes], None
    # Until the warm-up is in: the saved times scaled as the shape that moved most.
    logger.info(
        "saved calibration: the cheap shapes moved by %.2f-%.2fx: serving on it scaled "
        "by %.2f; the warm-up runs while the engine is idle",
        low,
        high,
        high,
    )
    first = [(s, now.get(s, before[s][0] * high)) for s in shapes]
    return first, Remaining(list(plans), repeats, [], shapes, saved, first)


def _first_plans(plans: list[StepPlan]) -> list[StepPlan]:
    """The shapes of a first fit: the smallest and the largest decode batch (at the short
    and the long context), and the first prompt chunk (the shortest)."""
    decodes = [plan for plan in plans if plan.num_batched_tokens == len(plan.sequences)]
    prompts = [plan for plan in plans if plan.num_batched_tokens > len(plan.sequences)]
    return [*decodes[:1], *decodes[1:][-1:], *prompts[:1]]


@dataclass(slots=True)
class Remaining:
    """The shapes still to measure, one engine step at a time (:meth:`step`, each shape
    once unmeasured, then ``repeats`` times measured), in the slots nothing holds: a
    slot the prefix cache keeps is never overwritten for a calibration step, so a shape
    that needs more slots than are free waits.  Every shape's timings are saved when all
    are measured, as a full warm-up's would be."""

    plans: list[StepPlan]
    repeats: int
    #: The shapes measured so far, and their timings.
    measured: Timings
    #: Every shape, in the warm-up's order.
    shapes: list[StepShape]
    saved: Path | None
    #: What the cost model started from (kept for the shapes never measured here).
    first: Observations = field(default_factory=list)
    _runs: int = 0
    _current: list[float] = field(default_factory=list)
    _used: set[int] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return not self.plans

    def slots_needed(self) -> int:
        """The slots of the next step: the shape under way's (it goes on), else the
        smallest left."""
        if self._runs:
            return len(self.plans[0].sequences)
        return min(len(plan.sequences) for plan in self.plans)

    def fits(self, num_free_slots: int) -> bool:
        """Can a step be taken in this many free slots?"""
        return self.slots_needed() <= num_free_slots

    def step(self, engine: Engine, free_slots: list[int]) -> None:
        """Run one step of the next shape that fits in ``free_slots`` (see :meth:`fits`),
        its sequences placed in those slots."""
        if not self._runs:  # choose the next shape: the first that fits
            fitting = next(p for p in self.plans if len(p.sequences) <= len(free_slots))
            self.plans.remove(fitting)
            self.plans.insert(0, fitting)
        plan = _placed(self.plans[0], free_slots)
        self._used.update(seq.kv_slot for seq in plan.sequences)
        started = time.perf_counter()
        engine.step(plan)
        if self._runs:  # the first step of a shape pays its one-off costs: not a sample
            self._current.append(time.perf_counter() - started)
        self._runs += 1
        if self._runs > self.repeats:
            self.measured.append((_shape(plan), self._current))
            self.plans.pop(0)
            self._runs, self._current = 0, []
        if self.done:
            self.release(engine)
            if self.saved is not None:
                _save(self.saved, self.timings())

    def forget_decode(self) -> None:
        """The engine decodes otherwise now (its compiled step): the first fit's decode
        shapes no longer stand for the ones not measured here."""
        self.first = [(s, t) for s, t in self.first if s.num_batched_tokens != s.num_seqs]

    def release(self, engine: Engine) -> None:
        """Hand back the slots the steps wrote (clean, as a warm-up leaves them)."""
        if self._used:
            engine.step(StepPlan(freed_kv_slots=sorted(self._used)))
            self._used.clear()

    def timings(self) -> Timings:
        by_shape = dict(self.measured)
        return [(shape, by_shape[shape]) for shape in self.shapes if shape in by_shape]

    def observations(self) -> Observations:
        """Every shape measured here, and the first fit's others."""
        known = dict(self.first) | dict(_medians(self.timings()))
        return [(shape, known[shape]) for shape in self.shapes if shape in known]

    def snapshot(self) -> dict[str, int]:
        return {"shapes_measured": len(self.measured), "shapes_left": len(self.plans)}


def _placed(plan: StepPlan, free_slots: list[int]) -> StepPlan:
    """``plan`` with its sequences moved to the first of ``free_slots``."""
    slots = {seq.kv_slot: free_slots[i] for i, seq in enumerate(plan.sequences)}
    return StepPlan(sequences=[replace(seq, kv_slot=slots[seq.kv_slot]) for seq in plan.sequences])


def _plans(num_slots: int, max_model_len: int, max_num_batched_tokens: int) -> list[StepPlan]:
    longest = max(1, max_model_len - 1)
    contexts = sorted({min(64, longest), min(512, longest)})
    plans: list[StepPlan] = []
    for context in contexts:
        for n in sorted({1, 4, min(16, num_slots)}):
            if n <= num_slots:
                plans.append(_decode(n, context))
    plans.append(_prefill(0, min(64, max_num_batched_tokens, longest), num_decoding=0, context=0))
    mixed = min(8, num_slots - 1)
    chunk = min(256, max_num_batched_tokens - mixed, longest)
    if mixed > 0 and chunk > 0:
        # Deep into its prompt: its attention over the positions before it is what makes
        # a late chunk dear, and what stall-free prefill sizes chunks by.
        deep = max(0, min(768, longest - chunk))
        plans.append(_prefill(mixed, chunk, mixed, contexts[0], start=deep))
    # The largest step the scheduler can plan: every other slot decoding at the longer
    # context beside a prompt chunk that fills the token budget, so that the first fit
    # spans the shapes of a full batch rather than extrapolating to them.
    full = num_slots - 1
    chunk = min(max_num_batched_tokens - full, longest)
    if full > mixed and chunk > 0:
        plans.append(_prefill(full, chunk, full, contexts[-1]))
    return plans


def _shape(plan: StepPlan) -> StepShape:
    return StepShape.of(plan)


Timings = list[tuple[StepShape, list[float]]]


def _time(engine: Engine, plans: list[StepPlan], repeats: int) -> Timings:
    """Each plan's shape and its ``repeats`` timings (after one unmeasured run)."""
    for plan in plans:  # the first step of each shape pays one-off costs: not a sample
        engine.step(plan)
    timings: list[list[float]] = [[] for _ in plans]
    for _ in range(repeats):
        for plan, seconds in zip(plans, timings, strict=True):
            started = time.perf_counter()
            engine.step(plan)
            seconds.append(time.perf_counter() - started)
    return [(_shape(plan), seconds) for plan, seconds in zip(plans, timings, strict=True)]


def _medians(timings: Timings) -> Observations:
    # The median of each shape's timings: a step slowed by something else on the machine
    # (another process, a page fault) does not skew the first fit.
    return [(shape, statistics.median(seconds)) for shape, seconds in timings]


def _reuse(engine: Engine, plans: list[StepPlan], repeats: int, saved: Path) -> Observations | None:
    """The saved calibration, scaled to what the cheap shapes measure now; None when there
    is none for these shapes or the cheap shapes do not agree on a factor."""
    shapes = [_shape(plan) for plan in plans]
    before = _read_saved(saved, shapes)
    if before is None:
        return None
    cheap = _cheapest(plans, {shape: fastest for shape, (_, fastest) in before.items()})
    last, moved = _check(engine, cheap, before, repeats, CHECK_ATTEMPTS)
    if not _agreed(moved):
        logger.info("saved calibration not reused: measuring every shape")
        return None
    factor = statistics.median(moved.values())
    logger.info(
        "saved calibration reused: %d of %d shapes measured (%.2f-%.2fx the saved "
        "times), the rest scaled by %.2f",
        len(moved),
        len(shapes),
        min(moved.values()),
        max(moved.values()),
        factor,
    )
    now = dict(_medians(last))  # the check that agreed
    return [(shape, now.get(shape, before[shape][0] * factor)) for shape in shapes]


#: A saved calibration: each shape's median and fastest step.
Saved = dict[StepShape, tuple[float, float]]


def _read_saved(saved: Path, shapes: list[StepShape]) -> Saved | None:
    """Each saved shape's median and fastest step; None when there is no file, or it is
    unreadable or of other shapes."""
    try:
        rows = json.loads(saved.read_text(encoding="utf-8"))["observations"]
        # shape (its chunks last, when saved), median and fastest step
        before = {StepShape(*row[:3], *row[5:7]): (float(row[3]), float(row[4])) for row in rows}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        logger.info("saved calibration not usable (%s): measuring every shape", exc)
        return None
    if set(shapes) != set(before):
        logger.info("saved calibration is of other shapes: measuring every shape")
        return None
    return before


def _check(
    engine: Engine,
    cheap: list[StepPlan],
    before: Saved,
    repeats: int,
    attempts: int,
) -> tuple[Timings, dict[StepShape, float]]:
    """Time the cheap shapes (again, up to ``attempts`` times, while they disagree): the
    last check's timings, and how far each shape moved from its saved fastest step."""
    timings: dict[StepShape, list[float]] = {_shape(plan): [] for plan in cheap}
    last: Timings = []
    moved: dict[StepShape, float] = {}
    for attempt in range(1, attempts + 1):
        last = _time(engine, cheap, repeats)
        for shape, seconds in last:
            timings[shape] += seconds
        # Whether the shapes moved alike is judged on each one's fastest step, now and
        # then: the others may have been slowed by something else on the machine (which
        # only ever adds time), and so may a saved median.
        moved = {shape: min(seconds) / before[shape][1] for shape, seconds in timings.items()}
        if _agreed(moved):
            break
        logger.info(
            "saved calibration: the cheap shapes moved by %.2f-%.2fx (check %d of %d)",
            min(moved.values()),
            max(moved.values()),
            attempt,
            attempts,
        )
    return last, moved


def _agreed(moved: dict[StepShape, float]) -> bool:
    """Did every shape move by the same factor (within :data:`CHECK_SPREAD`)?"""
    return max(moved.values()) <= CHECK_SPREAD * min(moved.values())


def _cheapest(plans: list[StepPlan], fastest: dict[StepShape, float]) -> list[StepPlan]:
    """The cheapest plans whose saved steps add up to at most :data:`CHECK_SHARE` of a pass
    over all of them, and at least two (in the warm-up's order)."""
    budget = CHECK_SHARE * sum(fastest.values())
    chosen: set[StepShape] = set()
    spent = 0.0
    for shape in sorted(fastest, key=fastest.__getitem__):
        if len(chosen) >= 2 and spent + fastest[shape] > budget:
            break
        chosen.add(shape)
        spent += fastest[shape]
    return [plan for plan in plans if _shape(plan) in chosen]


def _save(path: Path, timings: Timings) -> None:
    rows = [
        [
            *(s.num_seqs, s.num_batched_tokens, s.num_context_tokens),
            *(statistics.median(t), min(t), s.num_chunks, s.num_chunk_pairs),
        ]
        for s, t in timings
    ]
    try:
        with atomic_path(path) as partial:
            partial.write_text(json.dumps({"observations": rows}), encoding="utf-8")
    except OSError as exc:  # a read-only cache: the next start measures again
        logger.warning("cannot save the calibration to %s: %s", path, exc)


def _decode(num_seqs: int, context: int) -> StepPlan:
    return StepPlan(sequences=[_sequence(slot, context, 1) for slot in range(num_seqs)])


def _prefill(
    slot: int, num_tokens: int, num_decoding: int, context: int, start: int = 0
) -> StepPlan:
    """``num_decoding`` sequences decoding beside a prompt chunk from ``start``."""
    decoding = [_sequence(s, context, 1) for s in range(num_decoding)]
    chunk = _sequence(slot, start, num_tokens, prompt=start + num_tokens)
    return StepPlan(sequences=[*decoding, chunk])


def _sequence(slot: int, start: int, num_new: int, prompt: int = 1) -> ScheduledSequence:
    tokens = [_TOKEN] * (start + num_new)
    return ScheduledSequence(
        request_id=f"warm-up-{slot}",
        kv_slot=slot,
        all_token_ids=tokens,
        start_position=start,
        num_new_tokens=num_new,
        sample=True,
        sampling=_SAMPLING,
        num_prompt_tokens=min(prompt, len(tokens)),
    )
