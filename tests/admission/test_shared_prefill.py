"""Admission in front of an engine that prefills the prompts it holds together (an
upstream such as llama.cpp's server): a newcomer's first token waits for the whole group,
and it is refused when it would make one of the group late."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluicegate.admission.slo import TTFTPredictor
from sluicegate.admission.work import Prefilling, group_end
from sluicegate.config import Settings
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.estimate import UpstreamEstimate
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.signals import PrefillLedger
from sluicegate.scheduler.request import Request, SamplingParams
from tests.fake_clock import FakeClock

#: 8 places, 50 ms a token, a prompt's first token 0.1 s + 2 ms a token: 0.3 s for 100.
UPSTREAM = UpstreamEstimate(
    seat_limit=8,
    step_seconds=0.05,
    mean_prompt_tokens=100.0,
    mean_output_tokens=20.0,
    max_num_batched_tokens=1 << 30,
    cost=(0.0,) * 6,
    ttft_base_seconds=0.1,
    ttft_per_token_seconds=0.002,
    shared_prefill=True,
)


def prefill(tokens: int) -> float:
    return 0.1 + 0.002 * tokens


def test_a_newcomer_finishes_with_the_prompts_it_is_prefilled_beside() -> None:
    # Alone: its own prompt.
    assert group_end([], 0.0, 100, prefill) == pytest.approx((0.3, 0))
    # Beside a 100-token prompt already there, due in 0.6 s: both done at 0.5 s, in time.
    there = Prefilling(start=0.0, tokens=100, due=0.6)
    end, late = group_end([there], 0.0, 100, prefill)
    assert end == pytest.approx(0.5) and late == 0
    # Due in 0.4 s it would have been in time alone (0.3 s) and is not with the newcomer.
    end, late = group_end([Prefilling(0.0, 100, 0.4)], 0.0, 100, prefill)
    assert end == pytest.approx(0.5) and late == 1
    # One already late without it is not counted against the newcomer.
    assert group_end([Prefilling(0.0, 100, 0.2)], 0.0, 100, prefill)[1] == 0
    # A prompt whose prefill is over by the time the newcomer arrives is not in its group.
    assert group_end([Prefilling(0.0, 100, 0.4)], 0.35, 100, prefill) == pytest.approx((0.65, 0))
    # Two queued prompts reaching the engine when it does are prefilled with it.
    queued = [Prefilling(1.0, 100, 5.0), Prefilling(1.0, 50, 5.0)]
    assert group_end(queued, 1.0, 100, prefill)[0] == pytest.approx(1.0 + prefill(250))


def holder(prompt: int, clock: FakeClock, *, computed: bool) -> Request:
    r = Request(
        f"h{id(object())}",
        [1] * prompt,
        SamplingParams(max_tokens=20, seed=1),
        arrival_time=clock(),
    )
    if computed:
        r.num_computed_tokens = prompt
    return r


def test_a_newcomer_that_would_make_a_prompt_being_prefilled_late_is_refused() -> None:
    clock = FakeClock()
    p = TTFTPredictor(lambda: UPSTREAM, clock)
    decoding = holder(100, clock, computed=True)
    clock.advance(0.1)
    # Dispatched 0.1 s ago with a 0.5 s objective: due in 0.4 s, and 0.3 s of prefill.
    prefilling = holder(100, clock, computed=False)
    clock.advance(0.1)
    prediction = p.predict([decoding, prefilling], [], 6, 100, objective_seconds=0.5)
    # Its own first token is in time (0.5 s) but the other's would come 0.1 s late.
    assert prediction.ttft_seconds == pytest.approx(0.5)
    assert prediction.num_delayed == 1 and prediction.misses(0.5)
    # With a looser objective both are in time.
    relaxed = p.predict([decoding, prefilling], [], 6, 100, objective_seconds=1.0)
    assert relaxed.num_delayed == 0 and not relaxed.misses(1.0)
    # Once the other's first token has come, the newcomer is prefilled alone.
    prefilling.num_computed_tokens = 100
    alone = p.predict([decoding, prefilling], [], 6, 100, objective_seconds=0.5)
    assert alone.ttft_seconds == pytest.approx(0.3) and not alone.misses(0.5)


def test_an_idle_engine_admits_a_second_client_even_if_it_slows_the_first() -> None:
    clock = FakeClock()
    p = TTFTPredictor(lambda: UPSTREAM, clock)
    first = holder(100, clock, computed=False)
    clock.advance(0.1)
    prediction = p.predict([first], [], 7, 100, objective_seconds=0.5)
    assert prediction.num_delayed == 0 and not prediction.misses(0.5)


def test_queued_prompts_that_start_with_a_newcomer_count_in_its_first_token() -> None:
    clock = FakeClock()
    p = TTFTPredictor(lambda: UPSTREAM, clock)
    # Two places, both held by answers with 10 tokens to go (0.5 s): a queued request
    # takes one when they free and the newcomer the other, at the same moment.
    holders = []
    for _ in range(2):
        h = holder(100, clock, computed=True)
        h.all_token_ids.extend([7] * 10)
        holders.append(h)
    queued = [holder(100, clock, computed=False)]
    fifo = TTFTPredictor(lambda: replace(UPSTREAM, shared_prefill=False), clock)
    alone = fifo.predict(holders, queued, 0, 100, objective_seconds=10.0)
    together = p.predict(holders, queued, 0, 100, objective_seconds=10.0)
    assert alone.wait_seconds == together.wait_seconds == pytest.approx(0.5)
    assert alone.ttft_seconds == pytest.approx(0.5 + 0.3)
    assert together.ttft_seconds == pytest.approx(0.5 + prefill(200))


def test_streams_wait_while_the_engine_prefills_the_prompts_it_holds() -> None:
    """llama.cpp's server decodes nothing while it prefills: a seat held by a stream with
    10 tokens to go (0.5 s) frees only after the 100-token prompt beside it (0.3 s)."""
    clock = FakeClock()
    decoding = holder(100, clock, computed=True)
    decoding.all_token_ids.extend([7] * 10)
    prefilling = holder(100, clock, computed=False)
    p = TTFTPredictor(lambda: UPSTREAM, clock)
    fifo = TTFTPredictor(lambda: replace(UPSTREAM, shared_prefill=False), clock)
    assert fifo.waits([decoding, prefilling], [holder(10, clock, computed=False)], 0) == (
        [pytest.approx(0.5)]
    )
    assert p.waits([decoding, prefilling], [holder(10, clock, computed=False)], 0) == (
        [pytest.approx(0.8)]
    )
    # The one prefilling frees its seat after the prompts and its 20 tokens.
    assert p.remaining_seconds(prefilling, stall=0.3) == pytest.approx(0.3 + 1.0)


def test_the_gateway_takes_its_upstreams_to_prefill_together_unless_told_otherwise() -> None:
    for prefill_setting, shared in (("together", True), ("in_order", False)):
        settings = Settings(
            engine="upstream", upstream=["http://upstream.test"], upstream_prefill=prefill_setting
        )
        core = UpstreamCore(
            UpstreamPool(settings), byte_level_tokenizer(), settings, max_model_len=1024
        )
        assert core.estimate().shared_prefill is shared
    assert Settings(engine="upstream", upstream=["http://u.test"]).upstream_prefill == "together"


def test_a_first_token_is_measured_against_the_prompts_prefilled_with_it() -> None:
    ledger = PrefillLedger()
    first = ledger.begin(100)
    second = ledger.begin(50)  # sent while the first is prefilled
    first.done()
    first.done()  # a second end (the call's own) changes nothing
    assert first.group == (100, 50)  # alone when sent; 50 tokens sent after it meanwhile
    third = ledger.begin(30)
    second.done()
    assert second.group == (150, 30)
    third.done()
    assert third.group == (80, 0) and ledger.tokens == 0
    assert ledger.begin(10).group is None  # not done yet
