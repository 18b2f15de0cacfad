"""From raw samples to figures: latency percentiles, goodput, QoE, rejections.

Definitions (see ``docs/bench.md``):

- *TTFT*: sent (just before connect) to the first token-bearing event received.
- *TPOT*: (last token time - first token time) / (tokens - 1), per request.
- *ITL*: the gap before each token after the first, as delivered; tokens that arrive in
  one coalesced event have a gap of 0 (the server's own ``inter_token_latency`` agrees).
- *e2e*: sent to ``data: [DONE]`` (or to the deliberate disconnect).
- *goodput*: requests per second that met both the TTFT and the TPOT objective, over
  the arrival window; rejected, failed and unsent requests count as misses, never as
  exclusions.  A slow reader's TPOT objective is relaxed to 1.25x its own reading pace.
- *QoE* (after Andes): the fraction of a request's expected tokens delivered no later
  than a reader at the expected pace needs them: token ``i`` is due at
  ``ttft_seconds + i / pace`` after sending, with ``pace`` the scenario's
  ``qoe_tokens_per_second`` (a slow reader's own pace if lower).  A rejected request
  scores 0.

Latency figures use each request's first attempt; a retry after ``Retry-After`` is
reported separately (how often it then succeeded).  With admission control, three more:

- *admitted TTFT*: the TTFT of first attempts the server admitted (not refused by status
  or by a final error event); one admitted but cut or failed before its first token
  counts with the time it waited, a lower bound, so a stalled queue cannot hide.
- *refusal latency*: sent (just before connect) to the complete 429/503 response.
- *retries at the advertised time*: retries sent within ``on_time_tolerance_seconds``
  of the refusal's arrival plus its advertised wait, and the fraction of them admitted;
  retries of refusals that said no seat was held (``x-sluicegate-refusal: overloaded``)
  are counted apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sluicegate.bench.records import Outcome, Sample
from sluicegate.bench.scenario import RetryAfter, ServiceObjectives
from sluicegate.bench.schedule import StagePlan

SLOW_READER_TPOT_SLACK = 1.25


@dataclass(slots=True)
class Percentiles:
    """Distribution of one quantity (seconds unless its name says otherwise)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls()
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(x) for x in np.percentile(array, [50, 90, 99]))
        return cls(len(values), float(array.mean()), p50, p90, p99)


@dataclass(slots=True)
class GroupStats:
    """The figures of one group of requests (a class, a tenant, a stage, or all)."""

    name: str
    window_seconds: float
    num_planned: int = 0
    num_sent: int = 0
    num_not_sent: int = 0
    num_completed: int = 0
    num_disconnected: int = 0
    num_rejected: int = 0
    num_errors: int = 0
    num_aborted: int = 0
    rejection_rate: float = 0.0
    ttft: Percentiles | None = None
    tpot: Percentiles | None = None
    itl: Percentiles | None = None
    e2e: Percentiles | None = None
    num_good: int = 0
    goodput_rps: float = 0.0
    goodput_fraction: float = 0.0
    qoe_mean: float | None = None
    qoe_p10: float | None = None
    #: QoE of the first attempts the server admitted, and the share of them at 1.0 (every
    #: token there before its reader needed it).
    qoe_admitted_mean: float | None = None
    qoe_admitted_full_fraction: float | None = None
    num_retried: int = 0
    num_retry_succeeded: int = 0
    retry_success_rate: float | None = None
    retry_after_mean_seconds: float | None = None
    num_admitted: int = 0
    #: Admitted, but no token came (cut, timed out, failed): in ``admitted_ttft`` as a
    #: lower bound.
    num_admitted_without_token: int = 0
    admitted_ttft: Percentiles | None = None
    #: Admitted attempts (first or retried) that a Sluicegate server promised a time to
    #: first token, and those whose first token (the server's own measure) came later.
    num_promised_ttft: int = 0
    num_past_objective: int = 0
    #: Refused by a final error event after being admitted (a slipped deadline).
    num_refused_in_stream: int = 0
    refusal_latency: Percentiles | None = None
    num_retries_on_time: int = 0
    num_retries_on_time_admitted: int = 0
    #: Retries of refusals that said no seat was held (``x-sluicegate-refusal:
    #: overloaded``), and those admitted: not counted among the retries on time.
    num_retries_unheld: int = 0
    num_retries_unheld_admitted: int = 0
    retry_on_time_admitted_fraction: float | None = None
    retry_lateness: Percentiles | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    output_tokens_per_second: float = 0.0
    offered_rps: float | None = None


def meets_slo(sample: Sample, slo: ServiceObjectives) -> bool:
    """Did this request's first attempt meet both the TTFT and the TPOT objective?"""
    attempt = sample.first
    if attempt is None or attempt.outcome not in (Outcome.COMPLETED, Outcome.DISCONNECTED):
        return False
    ttft = attempt.ttft_seconds
    if ttft is None or ttft > slo.ttft_seconds:
        return False
    limit = slo.tpot_seconds
    pace = sample.planned.read_tokens_per_second
    if pace is not None:
        limit = max(limit, SLOW_READER_TPOT_SLACK / pace)
    tpot = attempt.tpot_seconds
    return tpot is None or tpot <= limit


def qoe_score(sample: Sample, slo: ServiceObjectives) -> float:
    """Fraction of expected tokens delivered by the time a reader at the pace needs them."""
    attempt = sample.first
    planned = sample.planned
    expected = planned.disconnect_after_tokens or planned.max_tokens
    if attempt is None:
        return 0.0
    if attempt.outcome is Outcome.COMPLETED:
        expected = min(expected, attempt.completion_tokens)  # it legitimately ended sooner
        if expected == 0:
            return 1.0
    pace = slo.qoe_tokens_per_second
    if planned.read_tokens_per_second is not None:
        pace = min(pace, planned.read_tokens_per_second)
    times = attempt.token_times()[:expected]
    on_time = sum(1 for i, t in enumerate(times) if t <= slo.ttft_seconds + i / pace)
    return on_time / expected


def summarise(
    name: str,
    samples: Sequence[Sample],
    slo: ServiceObjectives,
    window_seconds: float,
    offered_rps: float | None = None,
    retry_policy: RetryAfter | None = None,
) -> GroupStats:
    """Every figure of one group of samples."""
    stats = GroupStats(name, window_seconds, num_planned=len(samples), offered_rps=offered_rps)
    _admission_figures(stats, samples, retry_policy or RetryAfter())
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    qoe: list[float] = []
    retry_after: list[float] = []
    qoe_admitted: list[float] = []
    for sample in samples:
        qoe.append(qoe_score(sample, slo))
        attempt = sample.first
        if attempt is None:
            stats.num_not_sent += 1
            continue
        if attempt.admitted:
            qoe_admitted.append(qoe[-1])
        stats.num_sent += 1
        outcome = attempt.outcome
        if outcome is Outcome.COMPLETED:
            stats.num_completed += 1
        elif outcome is Outcome.DISCONNECTED:
            stats.num_disconnected += 1
        elif outcome is Outcome.REJECTED:
            stats.num_rejected += 1
        elif outcome is Outcome.ABORTED:
            stats.num_aborted += 1
        else:
            stats.num_errors += 1
        if meets_slo(sample, slo):
            stats.num_good += 1
        for a in sample.attempts:
            if a.served and a.prompt_tokens:
                stats.prompt_tokens += a.prompt_tokens
            stats.completion_tokens += a.completion_tokens
        if attempt.ttft_seconds is not None:
            ttft.append(attempt.ttft_seconds)
        if attempt.tpot_seconds is not None:
            tpot.append(attempt.tpot_seconds)
        itl.extend(attempt.itl_seconds())
        if outcome in (Outcome.COMPLETED, Outcome.DISCONNECTED) and attempt.e2e_seconds:
            e2e.append(attempt.e2e_seconds)
        if attempt.retry_after_seconds is not None:
            retry_after.append(attempt.retry_after_seconds)
        retry = sample.retry
        if retry is not None:
            stats.num_retried += 1
            if retry.outcome in (Outcome.COMPLETED, Outcome.DISCONNECTED):
                stats.num_retry_succeeded += 1
    stats.rejection_rate = stats.num_rejected / stats.num_sent if stats.num_sent else 0.0
    stats.ttft, stats.tpot = Percentiles.of(ttft), Percentiles.of(tpot)
    stats.itl, stats.e2e = Percentiles.of(itl), Percentiles.of(e2e)
    if window_seconds > 0:
        stats.goodput_rps = stats.num_good / window_seconds
        stats.output_tokens_per_second = stats.completion_tokens / window_seconds
    stats.goodput_fraction = stats.num_good / len(samples) if samples else 0.0
    if qoe:
        stats.qoe_mean = float(np.mean(qoe))
        stats.qoe_p10 = float(np.percentile(qoe, 10))
    if qoe_admitted:
        stats.qoe_admitted_mean = float(np.mean(qoe_admitted))
        stats.qoe_admitted_full_fraction = sum(q >= 1.0 for q in qoe_admitted) / len(qoe_admitted)
    if stats.num_retried:
        stats.retry_success_rate = stats.num_retry_succeeded / stats.num_retried
    if retry_after:
        stats.retry_after_mean_seconds = float(np.mean(retry_after))
    return stats


def _admission_figures(stats: GroupStats, samples: Sequence[Sample], policy: RetryAfter) -> None:
    """Admitted-only TTFT, refusal latency, and retries at the advertised time."""
    admitted_ttft: list[float] = []
    refusals: list[float] = []
    lateness: list[float] = []
    for sample in samples:
        attempt = sample.first
        if attempt is None:
            continue
        if attempt.admitted:
            stats.num_admitted += 1
            ttft = attempt.ttft_seconds
            if ttft is None:
                stats.num_admitted_without_token += 1
                ttft = attempt.e2e_seconds or 0.0
            admitted_ttft.append(ttft)
        for each in sample.attempts:
            if each.admitted and each.past_objective is not None:
                stats.num_promised_ttft += 1
                stats.num_past_objective += each.past_objective
        if attempt.refused_in_stream:
            stats.num_refused_in_stream += 1
        if attempt.refused_by_status and attempt.e2e_seconds is not None:
            refusals.append(attempt.e2e_seconds)
        late = sample.retry_lateness_seconds
        retry = sample.retry
        if late is None or retry is None:
            continue
        lateness.append(late)
        if attempt.refusal == "overloaded":
            # Told that no seat was held for it: its retry is counted apart.
            stats.num_retries_unheld += 1
            stats.num_retries_unheld_admitted += retry.admitted
        elif abs(late) <= policy.on_time_tolerance_seconds:
            stats.num_retries_on_time += 1
            if retry.admitted:
                stats.num_retries_on_time_admitted += 1
    stats.admitted_ttft = Percentiles.of(admitted_ttft)
    stats.refusal_latency = Percentiles.of(refusals)
    stats.retry_lateness = Percentiles.of(lateness)
    if stats.num_retries_on_time:
        stats.retry_on_time_admitted_fraction = (
            stats.num_retries_on_time_admitted / stats.num_retries_on_time
        )


def _groups(samples: Sequence[Sample], key: Callable[[Sample], str]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for sample in samples:
        out.setdefault(key(sample), []).append(sample)
    return dict(sorted(out.items()))


def summarise_run(
    samples: Sequence[Sample],
    stages: Iterable[StagePlan],
    slo: ServiceObjectives,
    retry_policy: RetryAfter | None = None,
) -> dict[str, GroupStats]:
    """``all``, then per client class, per tenant and per stage."""
    stage_list = list(stages)
    window = stage_list[-1].end_seconds if stage_list else 0.0

    def group(name: str, members: Sequence[Sample], window_seconds: float = window) -> GroupStats:
        return summarise(name, members, slo, window_seconds, retry_policy=retry_policy)

    out = {"all": group("all", samples)}
    by_class = _groups(samples, lambda s: s.planned.client_class.value)
    for name, members in by_class.items():
        out[f"class={name}"] = group(f"class={name}", members)
    by_tenant = _groups(samples, lambda s: s.planned.tenant)
    for name, members in by_tenant.items():
        out[f"tenant={name}"] = group(f"tenant={name}", members)
    if len(by_class) > 1 and len(by_tenant) > 1:
        for name, members in _groups(
            samples, lambda s: f"{s.planned.tenant}/{s.planned.client_class.value}"
        ).items():
            out[f"tenant/class={name}"] = group(f"tenant/class={name}", members)
    by_stage = _groups(samples, lambda s: f"{s.planned.stage_index:03d}")
    for stage in stage_list:
        name = f"stage={stage.index}"
        stats = group(name, by_stage.get(f"{stage.index:03d}", []), stage.duration_seconds)
        stats.offered_rps = stage.offered_rps
        out[name] = stats
    return out


def ttft_growth_seconds_per_second(samples: Sequence[Sample]) -> float:
    """How fast TTFT grows over a window: the queue's growth, seconds per second.

    The median TTFT of the last third of sends minus that of the first third, over the
    time between their median send times.  Zero for a stable queue; ``rho - 1`` for a
    deterministic server offered ``rho`` times its capacity.  Requests with no first
    token (rejected, cut) are left out: rejections and goodput catch those.
    """
    points = sorted(
        (a.sent_offset_seconds, a.ttft_seconds)
        for s in samples
        if (a := s.first) is not None and a.ttft_seconds is not None
    )
    if len(points) < 6:
        return 0.0
    third = len(points) // 3
    head, tail = points[:third], points[-third:]
    dt = float(np.median([p[0] for p in tail]) - np.median([p[0] for p in head]))
    if dt <= 0:
        return 0.0
    return float(np.median([p[1] for p in tail]) - np.median([p[1] for p in head])) / dt
