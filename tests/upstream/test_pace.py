"""``max_tokens_per_second`` in upstream mode: the relay paces an upstream's deltas by the
embedded scheduler's rule (:func:`~sluicegate.scheduler.request.next_token_time`).

The relay used to wait ``interval × tokens so far`` after each delta, so each wait grew
with the answer (a 20-token answer at 10 tokens/s waited 21 s instead of 1.9 s).  Timed
with a fake clock: the relay's sleeps advance it, nothing depends on the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from sluicegate.config import Settings
from sluicegate.engine.output import RequestStream
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.engine.upstream.core import UpstreamCore
from sluicegate.engine.upstream.pool import UpstreamPool
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams, next_token_time
from tests.fake_clock import FakeClock
from tests.upstream.in_memory import answer_in_memory

MODEL = "paced-model"


def _event(text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return b'data: {"choices":[{"index":0,"text":"%s","finish_reason":%s}]}\n\n' % (
        text.encode(),
        reason.encode(),
    )


def _call_event(fragment: dict[str, object], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"tool_calls": [fragment]}, "finish_reason": finish}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


async def _relay(
    deltas: list[str], tokens_per_second: float, events: list[bytes] | None = None
) -> tuple[float, FinishReason]:
    """Relay an answer of ``deltas`` (or of ``events``) paced at ``tokens_per_second``;
    returns the seconds the relay slept (on the fake clock) and how the answer finished."""
    clock = FakeClock()
    slept = 0.0

    async def sleep(seconds: float) -> None:
        nonlocal slept
        slept += seconds
        clock.advance(seconds)
        await asyncio.sleep(0)

    async def body() -> AsyncIterator[bytes]:
        for text in deltas:
            yield _event(text)
        for event in events or [_event("", "length")]:
            yield event
        yield b"data: [DONE]\n\n"

    settings = Settings(engine="upstream", upstream=["http://upstream.test"])
    pool = UpstreamPool(settings)
    core = UpstreamCore(
        pool, byte_level_tokenizer(), settings, max_model_len=1 << 20, clock=clock, sleep=sleep
    )
    upstream = pool.upstreams[0]
    await answer_in_memory(upstream, lambda request: body(), MODEL)
    max_tokens = 100
    call = UpstreamCall("completion", {"model": MODEL, "prompt": "Once"}, MODEL, max_tokens)
    request = Request("r1", [79, 110, 99, 101], SamplingParams(seed=1, max_tokens=max_tokens))
    request.pace.min_token_interval_seconds = 1.0 / tokens_per_second
    stream = RequestStream("r1")
    core.add_request(request, stream, call)
    finish: FinishReason | None = None
    async with asyncio.timeout(30):
        while finish is None:
            finish = (await stream.get()).finish_reason
    await core.close()
    return slept, finish


def test_one_token_deltas_wait_one_interval_each() -> None:
    # 20 deltas of one token at 10 tokens/s: the first at once, then 0.1 s apart.
    slept, finish = asyncio.run(_relay(["a"] * 20, tokens_per_second=10.0))
    assert finish is FinishReason.LENGTH
    assert slept == pytest.approx(1.9)


def test_a_delta_of_several_tokens_waits_for_all_of_them() -> None:
    # 5 deltas of 4 tokens at 20 tokens/s: 20 tokens, the first free, so 19 intervals.
    slept, _ = asyncio.run(_relay(["abcd"] * 5, tokens_per_second=20.0))
    assert slept == pytest.approx(19 * 0.05)


def test_tool_call_tokens_are_paced_too() -> None:
    # One call, "f" and 9 bytes of arguments in three fragments: 10 tokens (bytes here),
    # delivered whole at its end, so 9 intervals at 10 tokens/s.
    start = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}
    events = [
        _call_event(start),
        _call_event({"index": 0, "function": {"arguments": '{"a": '}}),
        _call_event({"index": 0, "function": {"arguments": "12}"}}),
        _call_event({"index": 0, "function": {}}, "tool_calls"),
    ]
    slept, finish = asyncio.run(_relay([], tokens_per_second=10.0, events=events))
    assert finish is FinishReason.TOOL_CALLS
    assert slept == pytest.approx(0.9)


def test_the_rule_gives_one_interval_of_credit_not_a_burst() -> None:
    # On pace: the next token one interval after the last.
    assert next_token_time(10.0, 10.0, 0.5) == 10.5
    # Late by 3 s: one interval of credit (the next may come at once), not six.
    assert next_token_time(10.0, 13.0, 0.5) == 13.0
    # Several tokens at once push the next one back by all of them.
    assert next_token_time(10.0, 10.0, 0.5, num_tokens=4) == 12.0
