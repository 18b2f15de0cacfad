"""Stages joined by bounded channels (no server): backpressure, where it is held, the
end of a chain."""

from __future__ import annotations

import asyncio

from sluicegate.engine.output import RequestOutput
from sluicegate.pipeline.chain import StageChain
from sluicegate.scheduler.request import FinishReason


class Gate:
    """A stage that passes deltas on only while its gate is open."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.open = asyncio.Event()
        self.open.set()

    async def process(self, delta: RequestOutput) -> list[RequestOutput]:
        await self.open.wait()
        return [delta]


class Broken:
    name = "broken"

    async def process(self, delta: RequestOutput) -> list[RequestOutput]:
        raise RuntimeError("boom")


def token(i: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", f"t{i} ", 1, 3, i, finish, committed_token_ids=[i])


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_stalled_stage_fills_its_channel_and_the_backlog_waits_at_the_head() -> None:
    async def go() -> None:
        aborts: list[int] = []
        first, second = Gate("first"), Gate("second")
        chain = StageChain("r", [first, second], capacity_tokens=4, abort=lambda: aborts.append(1))
        second.open.clear()  # the second stage stalls
        for i in range(1, 21):
            chain.head.put(token(i))
        await settle()
        # The second stage holds one delta; its channel is full (4); the first stage waits
        # for room with one more; the rest waits at the head, where flow control sees it.
        assert chain.channels[1].pending_tokens == 4
        assert chain.head.pending_tokens == 20 - 4 - 2
        assert chain.tail.pending_tokens == 0
        assert chain.holdup() == "second"
        second.open.set()
        await settle()
        assert chain.tail.pending_tokens == 4  # now the tail is full: the client's turn
        assert chain.holdup() == "client"
        texts = []
        while len(texts) < 20:
            out = await chain.tail.get_one()
            texts.append(out.text)
            await settle()
        assert texts == [f"t{i} " for i in range(1, 21)]
        assert not aborts
        chain.close()
        await chain.wait_closed()

    asyncio.run(go())


def test_closing_a_chain_ends_its_client_s_output() -> None:
    async def go() -> None:
        gate = Gate("g")
        gate.open.clear()
        chain = StageChain("r", [gate], capacity_tokens=4, abort=lambda: None)
        chain.head.put(token(1))
        await settle()
        chain.close()  # the request was stopped (to be resumed elsewhere)
        await chain.wait_closed()
        out = await chain.tail.get_one()
        assert out.finish_reason == FinishReason.ABORT and out.text == ""
        assert chain.tail.finished

    asyncio.run(go())


def test_a_failing_stage_aborts_the_sequence_and_ends_with_an_error() -> None:
    async def go() -> None:
        aborts: list[int] = []
        chain = StageChain("r", [Broken()], capacity_tokens=4, abort=lambda: aborts.append(1))
        chain.head.put(token(1))
        out = await chain.tail.get_one()
        assert out.finish_reason == FinishReason.ERROR and aborts == [1]
        assert out.failure is not None and out.failure.status_code == 500
        assert "broken" in out.failure.message

    asyncio.run(go())
