"""Goodput, QoE, percentiles and queue-growth detection on hand-made samples (pure)."""

from __future__ import annotations

import pytest

from sluicegate.bench.records import Attempt, Outcome, Sample
from sluicegate.bench.scenario import RetryAfter, ServiceObjectives
from sluicegate.bench.schedule import ClientClass, PlannedRequest, StagePlan
from sluicegate.bench.stats import (
    meets_slo,
    qoe_score,
    summarise,
    summarise_run,
    ttft_growth_seconds_per_second,
)

SLO = ServiceObjectives(ttft_seconds=0.5, tpot_seconds=0.05, qoe_tokens_per_second=10.0)


def planned(
    index: int = 0,
    max_tokens: int = 10,
    client_class: ClientClass = ClientClass.NORMAL,
    read_tokens_per_second: float | None = None,
    disconnect_after_tokens: int | None = None,
) -> PlannedRequest:
    return PlannedRequest(
        index=index,
        stage_index=0,
        send_offset_seconds=float(index),
        tenant="t",
        client_class=client_class,
        target_prompt_tokens=8,
        max_tokens=max_tokens,
        disconnect_after_tokens=disconnect_after_tokens,
        read_tokens_per_second=read_tokens_per_second,
        prompt_seed=index,
    )


def streamed(
    ttft: float, gap: float, num_tokens: int, sent: float = 0.0, per_event: int = 1
) -> Attempt:
    events = [(ttft + i * gap, per_event) for i in range(num_tokens // per_event)]
    return Attempt(
        sent_offset_seconds=sent,
        status=200,
        outcome=Outcome.COMPLETED,
        prompt_tokens=8,
        completion_tokens=num_tokens,
        token_events=events,
        e2e_seconds=events[-1][0],
    )


def rejected() -> Attempt:
    return Attempt(0.0, status=429, outcome=Outcome.REJECTED, retry_after_seconds=1.0)


def test_goodput_counts_rejections_as_misses() -> None:
    samples = [
        Sample(planned(0), [streamed(0.1, 0.01, 10)]),  # good
        Sample(planned(1), [streamed(0.9, 0.01, 10)]),  # TTFT too slow
        Sample(planned(2), [streamed(0.1, 0.2, 10)]),  # TPOT too slow
        Sample(planned(3), [rejected(), streamed(0.1, 0.01, 10)]),  # rejected, retry ok
    ]
    stats = summarise("all", samples, SLO, window_seconds=2.0)
    assert stats.num_good == 1
    assert stats.goodput_rps == pytest.approx(0.5)
    assert stats.goodput_fraction == pytest.approx(0.25)
    assert stats.rejection_rate == pytest.approx(0.25)
    assert stats.num_retried == 1 and stats.retry_success_rate == 1.0
    assert stats.retry_after_mean_seconds == 1.0
    assert stats.ttft is not None and stats.ttft.count == 3
    assert stats.tpot is not None and stats.tpot.p50 == pytest.approx(0.01)


def test_slow_reader_tpot_objective_is_its_own_pace() -> None:
    slow = planned(0, client_class=ClientClass.SLOW, read_tokens_per_second=5.0)
    assert meets_slo(Sample(slow, [streamed(0.1, 0.2, 10)]), SLO)
    assert not meets_slo(Sample(slow, [streamed(0.1, 0.5, 10)]), SLO)


def test_qoe_is_the_fraction_of_tokens_on_time() -> None:
    # Due at 0.5 + i / 10 s.  Every token on time:
    assert qoe_score(Sample(planned(), [streamed(0.1, 0.05, 10)]), SLO) == 1.0
    # First token at 0.6 s, then 0.1 s apart: every token 0.1 s late.
    assert qoe_score(Sample(planned(), [streamed(0.6, 0.1, 10)]), SLO) == 0.0
    # Half arrive on time, the stream is then cut (the rest count as late).
    cut = streamed(0.1, 0.05, 5)
    cut.outcome = Outcome.ABORTED
    assert qoe_score(Sample(planned(), [cut]), SLO) == 0.5
    # Coalesced: 10 tokens in one event at 0.9 s; tokens 4..9 (due >= 0.9 s) are on time.
    assert qoe_score(Sample(planned(), [streamed(0.9, 0.0, 10, per_event=10)]), SLO) == 0.6
    assert qoe_score(Sample(planned(), [rejected()]), SLO) == 0.0
    # A disconnecting client expects only the tokens it waits for.
    leaver = planned(disconnect_after_tokens=2)
    assert qoe_score(Sample(leaver, [streamed(0.1, 0.05, 2)]), SLO) == 1.0


def test_itl_counts_coalesced_tokens_as_zero_gaps() -> None:
    attempt = streamed(0.1, 0.05, 6, per_event=3)
    assert attempt.itl_seconds() == pytest.approx([0.0, 0.0, 0.05, 0.0, 0.0])
    assert attempt.tpot_seconds == pytest.approx(0.01)


def test_ttft_growth_tells_a_growing_queue() -> None:
    stable = [Sample(planned(i), [streamed(0.1, 0.01, 4, sent=i * 0.1)]) for i in range(30)]
    growing = [
        Sample(planned(i), [streamed(0.1 + 0.2 * i * 0.1, 0.01, 4, sent=i * 0.1)])
        for i in range(30)
    ]
    assert abs(ttft_growth_seconds_per_second(stable)) < 1e-9
    assert ttft_growth_seconds_per_second(growing) == pytest.approx(0.2)


def test_run_summary_groups() -> None:
    samples = [
        Sample(planned(0), [streamed(0.1, 0.01, 10)]),
        Sample(
            planned(1, client_class=ClientClass.SLOW, read_tokens_per_second=5.0),
            [streamed(0.1, 0.2, 10)],
        ),
        Sample(planned(2), not_sent_reason="max_in_flight connections open"),
    ]
    groups = summarise_run(samples, [StagePlan(0, 3.0, 0.0, 1.0)], SLO)
    assert set(groups) == {"all", "class=normal", "class=slow", "tenant=t", "stage=0"}
    assert groups["all"].num_not_sent == 1 and groups["all"].num_good == 2
    assert groups["class=slow"].num_planned == 1
    assert groups["stage=0"].offered_rps == 3.0


def refused(
    sent: float = 0.0,
    e2e: float = 0.004,
    retry_after: float = 1.0,
    in_stream: bool = False,
) -> Attempt:
    """A refusal: a 429, or a final error event of an admitted stream."""
    return Attempt(
        sent,
        status=200 if in_stream else 429,
        outcome=Outcome.REJECTED,
        e2e_seconds=e2e,
        retry_after_seconds=retry_after,
        refused_after_seconds=e2e,
        refused_in_stream=in_stream,
        error_code="slo_unreachable",
    )


def test_admitted_ttft_keeps_requests_that_never_got_a_token() -> None:
    cut = Attempt(0.0, status=200, outcome=Outcome.ABORTED, e2e_seconds=5.0)
    samples = [
        Sample(planned(0), [streamed(0.1, 0.01, 10)]),
        Sample(planned(1), [streamed(0.3, 0.02, 10)]),
        Sample(planned(2), [cut]),  # admitted, queued until the run cut it
        Sample(planned(3), [refused(e2e=0.004)]),
        Sample(planned(4), [refused(e2e=0.008)]),
        Sample(planned(5), [refused(e2e=0.8, in_stream=True)]),  # not a fast refusal
    ]
    stats = summarise("all", samples, SLO, window_seconds=2.0)
    assert stats.num_admitted == 3 and stats.num_admitted_without_token == 1
    assert stats.admitted_ttft is not None and stats.admitted_ttft.count == 3
    assert stats.admitted_ttft.p50 == pytest.approx(0.3)
    # The cut request counts with its 5 s wait (a lower bound), so p99 cannot hide it ...
    assert stats.admitted_ttft.p99 == pytest.approx(0.3 + 0.98 * 4.7)
    # ... where the plain TTFT (first tokens only) knows nothing of it.
    assert stats.ttft is not None and stats.ttft.count == 2
    assert stats.tpot is not None and stats.tpot.p99 == pytest.approx(0.0199, abs=1e-4)
    # Refusal latency: sent to the complete 429; an in-stream refusal is counted apart.
    assert stats.num_rejected == 3 and stats.num_refused_in_stream == 1
    assert stats.refusal_latency is not None and stats.refusal_latency.count == 2
    assert stats.refusal_latency.p50 == pytest.approx(0.006)
    assert stats.refusal_latency.p99 == pytest.approx(0.00796)
    assert stats.num_good == 2 and stats.goodput_rps == pytest.approx(1.0)


def test_retry_success_counts_retries_made_at_the_advertised_time() -> None:
    policy = RetryAfter(on_time_tolerance_seconds=0.05)

    def retried(index: int, lateness: float, admitted: bool) -> Sample:
        first = refused(sent=float(index), e2e=0.004, retry_after=1.0)
        due = float(index) + 0.004 + 1.0
        retry = (
            streamed(0.1, 0.01, 10, sent=due + lateness) if admitted else refused(due + lateness)
        )
        return Sample(planned(index), [first, retry])

    samples = [
        retried(0, 0.001, admitted=True),
        retried(1, 0.002, admitted=True),
        retried(2, 0.003, admitted=False),
        retried(3, 0.5, admitted=True),  # half a second late: not at the advertised time
        Sample(planned(4), [refused(sent=4.0)]),  # never retried
    ]
    assert samples[0].retry_lateness_seconds == pytest.approx(0.001)
    stats = summarise("all", samples, SLO, window_seconds=5.0, retry_policy=policy)
    assert stats.num_retried == 4 and stats.num_retry_succeeded == 3
    assert stats.num_retries_on_time == 3 and stats.num_retries_on_time_admitted == 2
    assert stats.retry_on_time_admitted_fraction == pytest.approx(2 / 3)
    assert stats.retry_lateness is not None and stats.retry_lateness.count == 4
    groups = summarise_run(samples, [StagePlan(0, 1.0, 0.0, 5.0)], SLO, policy)
    assert groups["stage=0"].retry_on_time_admitted_fraction == pytest.approx(2 / 3)
    assert summarise("all", samples[4:], SLO, 1.0).retry_on_time_admitted_fraction is None


def test_admitted_attempts_past_the_servers_own_objective_are_counted() -> None:
    def promised(server_ttft: float, objective: float | None, sent: float = 0.0) -> Attempt:
        attempt = streamed(server_ttft, 0.01, 4, sent=sent)
        attempt.server_ttft_seconds, attempt.ttft_objective_seconds = server_ttft, objective
        return attempt

    samples = [
        Sample(planned(0), [promised(0.3, 0.5)]),
        Sample(planned(1), [promised(0.7, 0.5)]),  # late
        Sample(planned(2), [refused(), promised(0.9, 0.5, sent=1.0)]),  # its retry, late
        Sample(planned(3), [promised(0.9, None)]),  # static admission: nothing promised
        Sample(planned(4), [refused()]),
    ]
    stats = summarise("all", samples, SLO, window_seconds=2.0)
    assert (stats.num_past_objective, stats.num_promised_ttft) == (2, 3)
