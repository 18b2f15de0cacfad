"""Find the sustainable request rate (the knee) of a target under a scenario's load mix.

Each *trial* offers one rate for ``trial_seconds`` with the scenario's arrival process
and request mix, then judges it.  A trial is sustainable when

- at most ``max_rejected_fraction`` of its requests were rejected (429/503), and at
  most as many failed (errors, timeouts, cut at the end of the drain window),
- the queue is not growing without bound: TTFT grows by at most ``max_ttft_growth``
  seconds per second across the trial (an overloaded server's TTFT climbs at
  ``rho - 1``), and
- goodput holds: at least ``min_goodput_fraction`` of requests met both objectives.

Before each trial after the first, the target is given time to go idle by its
``/metrics`` (a plain engine such as llama-server keeps working through what the last
trial's cut clients left it, and the next trial would start behind it).

The rate ramps up by ``growth`` until a trial fails (or down until one passes), then
bisects between the highest sustainable and the lowest unsustainable rate until they are
within ``precision`` of each other.  The capacity is the middle of that bracket.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from sluicegate.bench.records import Sample
from sluicegate.bench.runner import Runner
from sluicegate.bench.scenario import CapacitySearch, Stage
from sluicegate.bench.schedule import build_schedule
from sluicegate.bench.scrape import wait_until_idle
from sluicegate.bench.stats import summarise, ttft_growth_seconds_per_second


@dataclass(slots=True)
class Trial:
    """One offered rate and the verdict on it."""

    index: int
    rate_rps: float
    sustainable: bool
    reasons: list[str]
    num_requests: int
    rejected_fraction: float
    failed_fraction: float
    goodput_fraction: float
    ttft_growth_seconds_per_second: float
    ttft_p90_seconds: float | None
    completed_rps: float


@dataclass(slots=True)
class CapacityResult:
    """The knee, the bracket it lies in, and every trial that found it."""

    capacity_rps: float
    sustainable_rps: float | None
    unsustainable_rps: float | None
    trials: list[Trial] = field(default_factory=list)
    note: str = ""
    scenario_name: str = ""
    target_url: str = ""


def judge(
    index: int, rate_rps: float, samples: list[Sample], runner: Runner, search: CapacitySearch
) -> Trial:
    """Was ``rate_rps`` sustainable, given this trial's samples?"""
    stats = summarise("trial", samples, runner.scenario.slo, search.trial_seconds, rate_rps)
    num = len(samples)
    rejected = stats.num_rejected / num if num else 0.0
    failed = (stats.num_errors + stats.num_aborted + stats.num_not_sent) / num if num else 0.0
    growth = ttft_growth_seconds_per_second(samples)
    reasons = []
    if rejected > search.max_rejected_fraction:
        reasons.append(f"{rejected:.1%} rejected")
    if failed > search.max_rejected_fraction:
        reasons.append(f"{failed:.1%} failed or cut")
    if growth > search.max_ttft_growth:
        reasons.append(f"TTFT grows {growth:.3f} s/s (queue growing)")
    if num and stats.goodput_fraction < search.min_goodput_fraction:
        reasons.append(f"goodput only {stats.goodput_fraction:.0%} of requests")
    return Trial(
        index=index,
        rate_rps=rate_rps,
        sustainable=not reasons,
        reasons=reasons,
        num_requests=num,
        rejected_fraction=rejected,
        failed_fraction=failed,
        goodput_fraction=stats.goodput_fraction,
        ttft_growth_seconds_per_second=growth,
        ttft_p90_seconds=stats.ttft.p90 if stats.ttft else None,
        completed_rps=_completed_rps(samples),
    )


def _completed_rps(samples: list[Sample]) -> float:
    """Completions over the time from the first send to the last completion."""
    ends = [
        a.sent_offset_seconds + a.e2e_seconds
        for s in samples
        if (a := s.first) is not None and a.served and a.e2e_seconds is not None
    ]
    starts = [a.sent_offset_seconds for s in samples if (a := s.first) is not None]
    if len(ends) < 2 or not starts:
        return 0.0
    span = max(ends) - min(starts)
    return len(ends) / span if span > 0 else 0.0


def find_capacity(
    runner: Runner,
    search: CapacitySearch | None = None,
    *,
    seed: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> CapacityResult:
    """Ramp, then bisect, to the highest sustainable rate.  Bounded by ``max_trials``."""
    scenario = runner.scenario
    search = search or scenario.capacity
    base_seed = scenario.seed if seed is None else seed
    drain = search.trial_seconds if search.drain_seconds is None else search.drain_seconds
    trials: list[Trial] = []
    low: float | None = None
    high: float | None = None
    rate = min(search.start_rps, search.max_rps)
    note = ""
    while len(trials) < search.max_trials:
        trial_scenario = scenario.model_copy(
            update={"stages": [Stage(duration_seconds=search.trial_seconds, rate_rps=rate)]}
        )
        schedule = build_schedule(trial_scenario, seed=base_seed + len(trials))
        label = f"trial {len(trials) + 1} at {rate:.3g} req/s"
        if trials:  # not behind what the last trial's cut clients left a plain engine
            wait_until_idle(runner.target.base_url, timeout_seconds=drain + 30.0)
        result = runner.run(schedule, label, drain_timeout_seconds=drain, settle_seconds=0.3)
        trial = judge(len(trials), rate, result.samples, runner, search)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        if trial.sustainable:
            low = rate if low is None else max(low, rate)
        else:
            high = rate if high is None else min(high, rate)
        if high is None:
            if rate >= search.max_rps:
                note = f"sustainable up to max_rps={search.max_rps:g}: a lower bound"
                break
            rate = min(rate * search.growth, search.max_rps)
        elif low is None:
            rate = rate / search.growth
            if rate < 1e-3:
                note = "no rate was sustainable"
                break
        elif (high - low) / low <= search.precision:
            break
        else:
            rate = (low + high) / 2
    else:
        note = f"stopped after max_trials={search.max_trials}; the bracket may be wide"
    if low is not None and high is not None:
        capacity = (low + high) / 2
    elif low is not None:
        capacity = low
    else:
        capacity = 0.0 if high is None else high / search.growth
        note = note or "no rate was sustainable"
    if not math.isfinite(capacity):
        capacity = 0.0
    return CapacityResult(capacity, low, high, trials, note, scenario.name, runner.target.base_url)
