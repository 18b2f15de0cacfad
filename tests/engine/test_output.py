"""A request's output channel: merging deltas, the flush policy, credit-sized takes."""

from __future__ import annotations

import asyncio

import pytest

from sluicegate.engine.output import FlushPolicy, RequestOutput, RequestStream
from sluicegate.scheduler.request import FinishReason


def delta(text: str, finish: FinishReason | None = None, committed: int = 0) -> RequestOutput:
    return RequestOutput("r", text, 1, 5, 0, finish, committed_token_ids=[committed])


def test_pending_deltas_merge_into_one_with_the_last_totals() -> None:
    stream = RequestStream("r")
    for i, text in enumerate(["a", "b", "c"]):
        stream.put(delta(text, committed=i))
    assert (stream.pending_tokens, stream.pending_bytes, stream.total_tokens) == (3, 3, 3)
    merged = asyncio.run(stream.get())
    assert merged.text == "abc" and merged.num_new_tokens == 3
    assert merged.committed_token_ids == [0, 1, 2]
    assert (stream.pending_tokens, stream.pending_bytes) == (0, 0)


def test_nothing_is_taken_after_the_final_delta() -> None:
    stream = RequestStream("r")
    stream.put(delta("end", FinishReason.STOP))
    stream.put(delta("late"))
    assert stream.finished and stream.pending_tokens == 1
    assert stream.timings.finish_time is not None


def test_first_token_at_once_then_coalesced_by_interval() -> None:
    async def main() -> list[str]:
        stream = RequestStream("r")
        policy = FlushPolicy(interval_seconds=0.2, max_tokens=100, heartbeat_seconds=5)
        loop = asyncio.get_running_loop()
        stream.put(delta("1"))
        first = await stream.next(policy)
        assert first is not None
        for i, text in enumerate("234"):
            loop.call_later(0.02 * (i + 1), stream.put, delta(text))
        started = loop.time()
        second = await stream.next(policy)
        assert second is not None
        assert loop.time() - started >= 0.15  # waited for the interval, not the first put
        return [first.text, second.text]

    assert asyncio.run(main()) == ["1", "234"]


def test_max_tokens_flushes_before_the_interval() -> None:
    async def main() -> str:
        stream = RequestStream("r")
        policy = FlushPolicy(interval_seconds=10, max_tokens=3, heartbeat_seconds=5)
        stream.put(delta("x"))
        await stream.next(policy)
        for text in "abc":
            stream.put(delta(text))
        out = await asyncio.wait_for(stream.next(policy), 1.0)
        assert out is not None
        return out.text

    assert asyncio.run(main()) == "abc"


def test_a_heartbeat_is_due_when_nothing_comes() -> None:
    async def main() -> RequestOutput | None:
        policy = FlushPolicy(interval_seconds=0.01, max_tokens=4, heartbeat_seconds=0.05)
        return await RequestStream("r").next(policy)

    assert asyncio.run(main()) is None


def test_zero_interval_takes_each_delta_on_its_own() -> None:
    async def main() -> list[str]:
        stream = RequestStream("r")
        for text in "ab":
            stream.put(delta(text))
        policy = FlushPolicy(interval_seconds=0, max_tokens=4, heartbeat_seconds=1)
        outs = [await stream.next(policy) for _ in range(2)]
        return [o.text for o in outs if o is not None]

    assert asyncio.run(main()) == ["a", "b"]


@pytest.mark.parametrize(("budget", "expected"), [(0, None), (2, "ab"), (10, "abc")])
def test_take_respects_a_token_budget(budget: int, expected: str | None) -> None:
    stream = RequestStream("r")
    for text in "abc":
        stream.put(delta(text))
    taken = stream.take(budget)
    assert (taken.text if taken is not None else None) == expected


def test_every_put_reaches_the_watcher() -> None:
    stream = RequestStream("r")
    seen: list[int] = []
    stream.on_put = lambda s: seen.append(s.pending_tokens)
    for text in "abc":
        stream.put(delta(text))
    assert seen == [1, 2, 3]
