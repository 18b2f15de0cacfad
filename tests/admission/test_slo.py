"""Admission by objective on a fake clock: predictions, refusals with held seats, learning."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from sluicegate.admission.objectives import (
    AUTO_TTFT_FLOOR_SECONDS,
    Objectives,
    auto_ttft_seconds,
)
from sluicegate.admission.slo import (
    QUIET_AFTER_REFUSAL_SECONDS,
    Prediction,
    SLOAdmission,
    TTFTPredictor,
)
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.types import PriorityClass
from tests.fake_clock import FakeClock

#: 4 seats, 50 ms a step, typical answers of 20 tokens, prefill free: 1 s a request.
ESTIMATE = ServiceEstimate(
    seat_limit=4,
    step_seconds=0.05,
    mean_prompt_tokens=0.0,
    mean_output_tokens=20.0,
    max_num_batched_tokens=512,
    cost=(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
)


def predictor(return_prior: float = 1.0) -> tuple[TTFTPredictor, FakeClock]:
    """Holding a seat for every promise (until some lapse), unless told otherwise."""
    clock = FakeClock()
    p = TTFTPredictor(
        lambda: ESTIMATE, clock, max_retry_after_seconds=30.0, return_prior=return_prior
    )
    return p, clock


def request(produced: int = 0, max_tokens: int = 20, ignore_eos: bool = True) -> Request:
    r = Request(
        f"r{id(object())}",
        [1, 2, 3],
        SamplingParams(max_tokens=max_tokens, seed=1, ignore_eos=ignore_eos),
    )
    r.all_token_ids.extend([7] * produced)
    r.num_computed_tokens = r.num_tokens
    return r


def test_a_holder_frees_its_seat_when_its_remaining_output_is_done() -> None:
    p, _ = predictor()
    assert p.remaining_seconds(request(produced=15)) == pytest.approx(0.25)
    # Without ignore_eos the typical answer length is the guess (never past max_tokens).
    assert p.remaining_seconds(request(produced=5, max_tokens=100, ignore_eos=False)) == (
        pytest.approx(0.75)
    )
    assert p.service_seconds(request()) == pytest.approx(1.0)


def test_the_wait_is_when_a_seat_frees_after_the_queue_ahead_takes_theirs() -> None:
    p, _ = predictor()
    free = p.predict([], [], num_free_seats=2, prompt_tokens=10, objective_seconds=1.0)
    assert free.wait_seconds == 0 and not free.misses(1.0)
    # Two seats, held for 0.25 s and 0.5 s more; two queued requests take them, each for
    # 1 s; the new one gets the first seat to free after that, at 1.25 s.
    holders = [request(produced=15), request(produced=10)]
    prediction = p.predict(holders, [request(), request()], 0, 10, objective_seconds=2.0)
    assert prediction.wait_seconds == pytest.approx(1.25)
    assert not prediction.misses(2.0) and prediction.misses(1.0)
    assert p.waits(holders, [request(), request(), request()], 0) == pytest.approx(
        [0.25, 0.5, 1.25]
    )


def test_a_request_that_would_start_at_once_is_never_refused() -> None:
    long_prompt = ServiceEstimate(4, 0.05, 0, 20, 64, (0.5, 0.0, 0.0, 0.0, 0.0, 0.0))
    slow = TTFTPredictor(lambda: long_prompt, FakeClock())
    prediction = slow.predict([], [], 1, prompt_tokens=4000, objective_seconds=1.0)
    assert prediction.ttft_seconds > 5 and not prediction.misses(1.0)


def test_a_prompt_longer_than_the_objective_may_wait_half_of_it() -> None:
    """Its prefill alone (3 s) misses a 1 s objective: served as fast as it can be, it is
    not refused for the step a finishing holder still takes, only for a real wait."""
    assert not Prediction(0.07, 3.07, alone_seconds=3.0).misses(1.0)
    assert not Prediction(0.5, 3.5, alone_seconds=3.0).misses(1.0)
    assert Prediction(0.6, 3.6, alone_seconds=3.0).misses(1.0)
    # A prompt that fits its objective alone is late past the objective, as before.
    assert Prediction(0.3, 1.1, alone_seconds=0.8).misses(1.0)
    assert not Prediction(0.2, 0.95, alone_seconds=0.75).misses(1.0)


def test_prompts_still_prefilling_delay_a_burst_that_finds_free_seats() -> None:
    # 10 ms a step plus 1 ms a token, chunks of 64 tokens, nothing decoding beside the
    # prompts (a seat limit of 1 in the estimate): a 64-token prompt takes 74 ms.
    engine = ServiceEstimate(1, 0.05, 0, 20, 64, (0.01, 0.0, 0.001, 0.0, 0.0, 0.0))
    p = TTFTPredictor(lambda: engine, FakeClock())
    alone = p.predict([], [], 8, prompt_tokens=64, objective_seconds=0.2)
    assert alone.ttft_seconds == pytest.approx(0.074) and not alone.misses(0.2)
    # Three requests admitted a moment ago hold seats, their prompts not yet computed:
    # the new one's first token comes after their 192 tokens and its own 64.
    burst = [Request(f"b{i}", [1] * 64, SamplingParams(max_tokens=20, seed=1)) for i in range(3)]
    crowded = p.predict(burst, [], 5, prompt_tokens=64, objective_seconds=0.2)
    assert crowded.wait_seconds == 0.0
    assert crowded.ttft_seconds == pytest.approx(4 * 0.074)
    assert crowded.misses(0.2) and not crowded.misses(0.3)
    # Once their prompts are computed, they no longer stand in its way; they decode beside
    # it, a token each in every step, which leaves 61 tokens of a step for its prompt: two
    # steps of 13 ms, and its 64 tokens.
    for r in burst:
        r.num_computed_tokens = r.num_prompt_tokens
    assert p.predict(burst, [], 5, 64, 0.2).ttft_seconds == pytest.approx(0.090)


def test_the_automatic_ttft_objective_is_twice_an_idle_256_token_prompt() -> None:
    # 40 ms a step, 1 ms a token, chunks of 512: a 256-token prompt alone takes 296 ms,
    # whatever the batch beside it would be.
    engine = ServiceEstimate(16, 0.05, 128, 64, 512, (0.04, 0.0, 0.001, 0.0, 0.0, 0.0))
    assert auto_ttft_seconds(engine) == pytest.approx(0.6)  # 592 ms, up to 10 ms
    fast = ServiceEstimate(16, 0.001, 128, 64, 512, (0.001, 0.0, 0.00001, 0.0, 0.0, 0.0))
    assert auto_ttft_seconds(fast) == AUTO_TTFT_FLOOR_SECONDS


def busy() -> list[Request]:
    """Two requests far from done (20 s each): the engine is not idle, and their seats
    free after anything these tests look at."""
    return [request(max_tokens=400), request(max_tokens=400)]


def client(i: int) -> bytes:
    """A request's fingerprint (what a refused client sends again)."""
    return b"client-%d" % i


def test_refusals_hold_seats_in_order_and_new_arrivals_do_not_take_them() -> None:
    p, clock = predictor()
    holders = [request(produced=19)]  # one seat, free in 50 ms
    queued = [request() for _ in range(3)]  # then busy for 3 s
    objective = 0.4
    refusals = [p.refuse(holders, queued, 0, objective, 10, client(i)) for i in range(4)]
    retry_afters = [r.retry_after_seconds for r in refusals]
    assert all(r.held for r in refusals)
    # Spread a seat's release apart (1 s: one seat, 1 s a request), not a herd, and come
    # back half the objective before the held seat frees.
    assert all(b - a == pytest.approx(1.0) for a, b in itertools.pairwise(retry_afters))
    assert retry_afters[0] == pytest.approx(0.05 + 3.0 - objective / 2)
    # Waiting behind the queue, the first would have seen its first token in 3.05 s.
    assert refusals[0].ttft_behind_seconds == pytest.approx(3.05)
    # Just before the first refused client comes back, the seat is free; a new request
    # would take it for a second and make that client wait past its objective (and past
    # the 1.5x a client back at its time is held to).
    clock.advance(retry_afters[0] - 0.1)
    fresh = p.predict(busy(), [], 1, 10, objective, client(99))
    assert fresh.wait_seconds == 0 and fresh.harms_promised and fresh.misses(objective)
    assert fresh.num_promised >= 1
    # Long before, a new request finishes in time: it may run.
    assert not p.predict(busy(), [], 1, 10, 5.0, client(99)).harms_promised
    # The refused client, back at its time, is not refused for its own seat; a stranger
    # arriving at the same moment is not taken for it.
    clock.advance(0.11)
    assert not p.predict(busy(), [], 1, 10, objective, client(0)).misses(objective)
    assert p.predict(busy(), [], 1, 10, objective, client(99)).harms_promised


def test_a_returning_client_is_not_held_back_for_the_clients_refused_after_it() -> None:
    p, clock = predictor()
    objective = 0.4
    queued = [request() for _ in range(2)]
    retry_afters = [
        p.refuse([], queued, 1, objective, 10, client(i)).retry_after_seconds for i in range(3)
    ]
    # The engine ran slower than booked: when the first comes back, one seat is free, and
    # the two refused after it are due while it would hold that seat.  Before its time, a
    # new arrival would push them past their objective; the first, back on time, is first
    # in line among the promised, and takes it.
    clock.advance(retry_afters[0] - 0.3)
    assert p.predict(busy(), [], 1, 10, objective, client(0)).harms_promised  # too early
    clock.advance(0.31)
    back = p.predict(busy(), [], 1, 10, objective, client(0))
    assert back.claims_promise and not back.harms_promised and not back.misses(objective)


def test_an_admission_uses_its_own_promise_and_unclaimed_promises_lapse() -> None:
    p, clock = predictor()
    queued = [request() for _ in range(8)]
    first = p.refuse([], queued, 1, 1.0, 10, client(1)).retry_after_seconds
    p.refuse([], queued, 1, 1.0, 10, client(2))
    assert p.snapshot()["promised_seats"] == 2
    clock.advance(first)
    p.admitted(client(3))  # a stranger: no promise is used
    assert p.snapshot()["promised_seats"] == 2
    p.admitted(client(1))  # the client came back: its seat is used
    assert p.snapshot()["promised_seats"] == 1 and p.snapshot()["promises_claimed"] == 1
    clock.advance(60.0)  # nobody came for the other one
    p.predict(busy(), [], 1, 10, 1.0)
    assert p.snapshot()["promised_seats"] == 0 and p.snapshot()["promises_lapsed"] == 1
    assert p.promises.return_rate < 1.0


def test_a_client_refused_again_keeps_one_promise() -> None:
    p, _ = predictor()
    queued = [request() for _ in range(8)]
    p.refuse([], queued, 1, 1.0, 10, client(1))
    p.refuse([], queued, 1, 1.0, 10, client(1))
    assert p.snapshot()["promised_seats"] == 1


def test_retry_after_is_capped_and_holds_no_seat_that_far() -> None:
    p, _ = predictor()
    for i in range(3):
        refusal = p.refuse([], [request() for _ in range(500)], 1, 1.0, 10, client(i))
        assert refusal.retry_after_seconds == pytest.approx(30.0) and not refusal.held
    assert p.snapshot()["promised_seats"] == 0  # not three clients booked at the cap


def test_measured_waits_correct_every_predicted_time() -> None:
    p, _ = predictor()
    for _ in range(60):  # queue waits come out twice as long as predicted
        p.observe_wait(predicted_seconds=0.5 * p.correction, measured_seconds=1.0)
    assert p.correction == pytest.approx(2.0, rel=0.05)
    assert p.service_seconds(request()) == pytest.approx(2.0, rel=0.05)
    p.observe_wait(predicted_seconds=0.0, measured_seconds=0.3)  # started at once: no signal
    assert p.correction == pytest.approx(2.0, rel=0.05)


def test_measured_ttft_errors_set_a_margin_at_their_90th_percentile() -> None:
    p, _ = predictor()
    before = p.predict([], [], num_free_seats=1, prompt_tokens=10, objective_seconds=1.0)
    assert before.margin_seconds == 0.0
    for i in range(19):
        p.observe_ttft(predicted_seconds=0.1, measured_seconds=0.1 + 0.01 * i)
    assert p.margin == 0.0  # too few to say
    for i in range(19, 100):  # errors of 0 .. 0.99 s: the 90th percentile is 0.89 s
        p.observe_ttft(predicted_seconds=0.1, measured_seconds=0.1 + 0.01 * i)
    assert p.margin == pytest.approx(0.89)
    after = p.predict([], [], num_free_seats=1, prompt_tokens=10, objective_seconds=1.0)
    assert after.ttft_seconds == pytest.approx(before.ttft_seconds + 0.89)
    assert after.margin_seconds == pytest.approx(0.89) and not after.misses(0.5)  # alone
    # With a request ahead it is late: refused with the margin counted.
    ahead = p.predict([request()], [], num_free_seats=0, prompt_tokens=10, objective_seconds=1.0)
    assert ahead.misses(1.0) and ahead.ttft_seconds > 1.0
    assert p.snapshot()["ttft_margin_seconds"] == pytest.approx(0.89)
    for _ in range(200):  # predictions that turn out early never make a negative margin
        p.observe_ttft(predicted_seconds=0.5, measured_seconds=0.2)
    assert p.margin == 0.0


def test_a_client_back_at_its_time_is_refused_only_past_the_late_tolerance() -> None:
    p, clock = predictor()
    slo = SLOAdmission(p, {PriorityClass.INTERACTIVE: Objectives(0.4, 0.1)})
    holders = [request(produced=10)]  # the only seat frees in 0.5 s
    retry_after = p.refuse(holders, [], 0, 0.4, 10, client(1)).retry_after_seconds
    clock.advance(retry_after + 0.01)
    # It is back, and its seat frees 0.1 s later than booked: 0.6 s from now, past the
    # 0.4 s objective but within 1.5x of it.  A stranger would be refused; it is not.
    late_seat = [request(produced=8)]
    back = p.predict(late_seat, [], 0, 10, 0.4, client(1))
    assert back.claims_promise and back.ttft_seconds == pytest.approx(0.6)
    assert not slo.refuses(PriorityClass.INTERACTIVE, back)
    stranger = replace(back, claims_promise=False)
    assert slo.refuses(PriorityClass.INTERACTIVE, stranger)
    # Past 1.5x, it is refused again.
    assert slo.refuses(PriorityClass.INTERACTIVE, replace(back, ttft_seconds=0.7))


def test_seats_are_held_for_the_share_of_clients_that_come_back() -> None:
    p, clock = predictor(return_prior=0.8)
    assert p.promises.return_rate == pytest.approx(0.8)  # before any promise is due
    queued = [request() for _ in range(4)]
    for i in range(10):
        p.refuse([], queued, 1, 1.0, 10, client(i))
    clock.advance(40.0)  # none came back
    p.snapshot()
    assert p.snapshot()["promises_lapsed"] == 10
    assert p.promises.return_rate == pytest.approx(1.6 / 12)
    for i in range(10):  # then every one does
        retry = p.refuse([], queued, 1, 1.0, 10, client(100 + i)).retry_after_seconds
        clock.advance(retry)
        p.admitted(client(100 + i))
        clock.advance(-retry)
    assert p.promises.return_rate == pytest.approx(11.6 / 22)


def test_a_newcomer_may_delay_a_promised_client_within_its_late_tolerance() -> None:
    p, clock = predictor()
    holders = [request(produced=10)]  # the only seat frees in 0.5 s
    retry = p.refuse(holders, [], 0, 0.4, 10, client(1)).retry_after_seconds
    # 0.1 s before that client is due, one seat is free: a newcomer taking it for 1 s
    # delays the client by 0.9 s: past 1.5 x 0.4 s.  Refused, and told why.
    clock.advance(retry - 0.1)
    assert p.predict(busy(), [], 1, 10, 0.4, client(2)).harms_promised
    # With a 0.8 s objective the delay is within 1.5x of it: admitted.
    assert not p.predict(busy(), [], 1, 10, 0.8, client(2)).harms_promised


def test_an_idle_engine_admits_a_newcomer_whatever_is_promised() -> None:
    p, clock = predictor()
    holders = [request(produced=10)]  # the only seat frees in 0.5 s
    retry = p.refuse(holders, [], 0, 0.4, 10, client(1)).retry_after_seconds
    clock.advance(retry - 0.1)
    # One request held, or none, and nothing queued: not refused for the promise.
    assert not p.predict([], [], 1, 10, 0.4, client(2)).harms_promised
    assert not p.predict([request(max_tokens=400)], [], 1, 10, 0.4, client(2)).harms_promised
    assert p.predict(busy(), [], 1, 10, 0.4, client(2)).harms_promised


def test_a_prompt_that_only_the_streams_beside_it_make_late_is_refused() -> None:
    """Served "as fast as it can be" means with nothing beside it: a 64-token prompt that
    alone takes 0.12 s but beside three decoding streams 0.49 s (two chunks, each in a
    step of theirs) misses a 0.3 s objective, where it used to pass as a long prompt.  A
    prompt too long for the objective even alone still passes, and an idle engine (one
    stream) still takes a second client."""
    engine = ServiceEstimate(4, 0.05, 0, 20, 64, (0.01, 0.05, 0.001, 0.0, 0.0, 0.0))
    clock = FakeClock()
    p = TTFTPredictor(lambda: engine, clock)
    streams = [request(produced=5) for _ in range(3)]
    short = p.predict(streams, [], 1, prompt_tokens=64, objective_seconds=0.3)
    assert short.wait_seconds == 0.0 and short.ttft_seconds == pytest.approx(0.49)
    assert short.alone_seconds == pytest.approx(0.124) and short.misses(0.3)
    long = p.predict(streams, [], 1, prompt_tokens=400, objective_seconds=0.3)
    assert long.alone_seconds == long.ttft_seconds and not long.misses(0.3)
    second = p.predict(streams[:1], [], 3, prompt_tokens=64, objective_seconds=0.25)
    assert second.ttft_seconds > 0.25 and not second.misses(0.25)
    # Unless it refused someone lately: then one request held is load, not idleness.
    p.refuse(streams, [], 0, 0.25, 64)
    assert p.predict(streams[:1], [], 3, prompt_tokens=64, objective_seconds=0.25).misses(0.25)
    clock.advance(QUIET_AFTER_REFUSAL_SECONDS + 0.1)
    assert not p.predict(streams[:1], [], 3, 64, objective_seconds=0.25).misses(0.25)


def test_a_lone_promise_holds_no_seat_once_most_refused_clients_never_return() -> None:
    """Clients that never retry: once fewer than half of the promises are claimed, a lone
    promise does not keep its seat from a newcomer (whose refusal would make another)."""
    p, clock = predictor(return_prior=0.8)
    holders = [request(produced=19)]  # one seat, free in 50 ms
    queued = [request() for _ in range(3)]  # then busy for 3 s
    objective = 0.4
    first = p.refuse(holders, queued, 0, objective, 10, client(0))
    clock.advance(first.retry_after_seconds - 0.1)
    # 80% of clients are taken to come back: the seat is held from a newcomer.
    assert p.predict(busy(), [], 1, 10, objective, client(99)).harms_promised
    clock.advance(30.0)  # it never came back
    for i in range(1, 3):  # nor did two more
        p.refuse(holders, queued, 0, objective, 10, client(i))
        clock.advance(30.0)
    assert p.snapshot()["promises_lapsed"] == 3 and p.promises.return_rate < 0.5
    lone = p.refuse(holders, queued, 0, objective, 10, client(3))
    clock.advance(lone.retry_after_seconds - 0.1)
    assert not p.predict(busy(), [], 1, 10, objective, client(99)).harms_promised


def prefilling(tokens: int) -> Request:
    """A holder whose prompt of ``tokens`` has not started."""
    return Request(f"p{id(object())}", [1] * tokens, SamplingParams(max_tokens=20, seed=1))


#: The engine prefills one prompt at a time when loaded (stall-free prefill), measured at
#: 100 prompt tokens a second while prompts waited; the cost model says prefill is free.
SERIAL = replace(
    ESTIMATE,
    mean_prompt_tokens=100.0,
    prefill_step_seconds=0.04,
    prefill_tokens_per_second=100.0,
    long_prompt_tokens=1000,
)


def test_prompts_wait_in_one_line_for_a_serial_prefill() -> None:
    """Under stall-free prefill the engine prefills its prompts one after another: a
    newcomer that finds a free seat still waits for the prompts ahead of it, at the rate
    measured while prompts waited."""
    clock = FakeClock()
    p = TTFTPredictor(lambda: SERIAL, clock, max_retry_after_seconds=30.0, return_prior=1.0)
    ahead = [prefilling(100), prefilling(100)]
    prediction = p.predict(ahead, [], 2, 100, objective_seconds=5.0)
    assert prediction.wait_seconds == 0
    assert prediction.ttft_seconds == pytest.approx(3.0)  # two prompts, then its own
    # The same engine prefilling each prompt in its own seat's time: 0 s.
    parallel = TTFTPredictor(lambda: replace(SERIAL, prefill_step_seconds=None), clock)
    assert parallel.predict(ahead, [], 2, 100, objective_seconds=5.0).ttft_seconds < 0.5


def test_refused_clients_are_booked_at_the_rate_prompts_are_prefilled() -> None:
    """Four seats free a second apart would take four clients a second; a serial prefill
    of a second a prompt takes one: the bookings are a second apart, not a quarter."""
    clock = FakeClock()
    p = TTFTPredictor(lambda: SERIAL, clock, max_retry_after_seconds=30.0, return_prior=1.0)
    holders = [request(produced=i) for i in (5, 10, 15, 19)]
    times = [p.refuse(holders, [], 0, 0.5, 100, client(i)).retry_after_seconds for i in range(5)]
    # (The first comes back half its objective's budget before its slot; each after it a
    # prompt's prefill after the one before.)
    assert all(b - a >= 1.0 - 1e-9 for a, b in itertools.pairwise(times[1:]))
    seats_only = TTFTPredictor(
        lambda: replace(SERIAL, prefill_step_seconds=None), clock, return_prior=1.0
    )
    times = [
        seats_only.refuse(holders, [], 0, 0.5, 100, client(i)).retry_after_seconds for i in range(5)
    ]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.5


def test_refused_clients_are_booked_on_the_booking_limit() -> None:
    """Seats the engine has not shown it sustains are not promised: four seats open, two
    to book on, and the promises come half as fast."""
    clock = FakeClock()
    estimates = {"now": ESTIMATE}
    p = TTFTPredictor(lambda: estimates["now"], clock, return_prior=1.0)
    holders = [request(produced=i) for i in (5, 10, 15, 19)]
    four = [p.refuse(holders, [], 0, 0.5, 10, client(i)).retry_after_seconds for i in range(8)]
    clock2 = FakeClock()
    estimates["now"] = replace(ESTIMATE, booking_seat_limit=2)
    q = TTFTPredictor(lambda: estimates["now"], clock2, return_prior=1.0)
    two = [q.refuse(holders, [], 0, 0.5, 10, client(i)).retry_after_seconds for i in range(8)]
    assert two[-1] - two[0] > 1.5 * (four[-1] - four[0])
