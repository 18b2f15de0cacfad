"""Flow control with fakes: water marks, credit, stall eviction.  No sockets, no engine.

The fake scheduler plays the pause state's owner: flow control only asks it.
"""

from __future__ import annotations

import time
from typing import Any

from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.stream.flow import FlowConfig, FlowController, StreamFlow


class FakeScheduler:
    """Implements the flow actions; pauses and resumes like the real scheduler (at once,
    unless ``lagging``, when it has not yet seen the command)."""

    def __init__(self, requests: dict[str, Request], lagging: bool = False) -> None:
        self.requests = requests
        self.lagging = lagging
        self.calls: list[tuple[str, str]] = []

    def pause(self, request_id: str) -> None:
        self.calls.append(("pause", request_id))
        if not self.lagging:
            self.requests[request_id].pause.begin(0.0)

    def resume(self, request_id: str) -> None:
        self.calls.append(("resume", request_id))
        if not self.lagging:
            self.requests[request_id].pause.end(0.0)

    def evict(self, request_id: str) -> None:
        self.calls.append(("evict", request_id))


def make(
    config: FlowConfig, *, credit_tokens: int | None = None, lagging: bool = False
) -> tuple[FlowController, StreamFlow, FakeScheduler]:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000, seed=1))
    scheduler = FakeScheduler({"r": request}, lagging=lagging)
    controller = FlowController(config, scheduler)
    flow = StreamFlow(RequestStream("r"), request, credit_tokens=credit_tokens)
    controller.register(flow)
    return controller, flow, scheduler


def produce(flow: StreamFlow, num_tokens: int) -> None:
    for _ in range(num_tokens):
        flow.stream.put(RequestOutput("r", "x", 1, 3, 0))


def deliver(flow: StreamFlow, num_tokens: int) -> None:
    """The writer takes ``num_tokens`` and the client acknowledges them (no transport)."""
    taken = flow.stream.take(num_tokens)
    assert taken is not None
    flow.record_write(len(taken.text), taken.num_new_tokens)


CONFIG = FlowConfig(high_water_tokens=8, low_water_tokens=2, stall_timeout_seconds=0)


def test_high_water_mark_asks_for_a_pause_and_low_water_for_a_resume() -> None:
    controller, flow, scheduler = make(CONFIG)
    produce(flow, 7)
    assert scheduler.calls == []
    produce(flow, 1)  # 8 unreceived: the high-water mark
    assert scheduler.calls == [("pause", "r")] and flow.paused
    produce(flow, 3)  # paused already: nothing more to ask
    assert scheduler.calls == [("pause", "r")]
    assert controller.num_paused == 1
    deliver(flow, 8)  # 3 left: inside the hysteresis band
    controller.check(flow)
    assert scheduler.calls == [("pause", "r")]
    deliver(flow, 1)  # 2 left: the low-water mark
    controller.check(flow)
    assert scheduler.calls == [("pause", "r"), ("resume", "r")] and not flow.paused


def test_asking_again_is_harmless_while_the_scheduler_has_not_acted() -> None:
    _, flow, scheduler = make(CONFIG, lagging=True)
    produce(flow, 10)
    # The scheduler owns the state: until it has paused the sequence, every check asks.
    assert scheduler.calls == [("pause", "r")] * 3
    assert not flow.paused


def test_credit_flow_pauses_when_buffered_tokens_use_up_the_credit() -> None:
    controller, flow, scheduler = make(CONFIG, credit_tokens=4)
    produce(flow, 3)
    assert scheduler.calls == []
    produce(flow, 1)
    assert scheduler.calls == [("pause", "r")]
    assert flow.credit_tokens is not None
    flow.credit_tokens += 10
    controller.check(flow)
    assert scheduler.calls[-1] == ("resume", "r")


def test_disabled_flow_control_never_pauses() -> None:
    _, flow, scheduler = make(FlowConfig(enabled=False, high_water_tokens=2, low_water_tokens=0))
    produce(flow, 50)
    assert scheduler.calls == []


def test_a_client_that_takes_nothing_is_evicted_after_the_stall_timeout() -> None:
    evicted: list[bool] = []
    config = FlowConfig(high_water_tokens=8, low_water_tokens=2, stall_timeout_seconds=5)
    controller, flow, scheduler = make(config)
    flow.on_evict = lambda: evicted.append(True)
    produce(flow, 3)
    now = time.monotonic()
    controller.check(flow, now + 4.9)
    assert evicted == []
    controller.check(flow, now + 5.1)
    assert evicted == [True] and ("evict", "r") in scheduler.calls
    calls = len(scheduler.calls)
    controller.check(flow, now + 6)  # evicted once
    assert len(scheduler.calls) == calls


def test_a_detached_stream_is_not_stalled_and_counts_nothing_received() -> None:
    config = FlowConfig(high_water_tokens=8, low_water_tokens=2, stall_timeout_seconds=1)
    controller, flow, scheduler = make(config)
    produce(flow, 4)
    deliver(flow, 4)
    flow.refresh_received()
    flow.detach()
    produce(flow, 4)
    controller.check(flow, time.monotonic() + 60)
    assert ("evict", "r") not in scheduler.calls  # its detach grace governs it instead
    assert flow.unreceived_tokens == 4
    produce(flow, 4)
    assert flow.paused  # nobody reads it: it pauses like any slow reader
    attachment = flow.attach(tokens_received=8)
    assert attachment == flow.attachment and flow.unreceived_tokens == 4


def test_unregistering_a_paused_stream_resumes_it() -> None:
    controller, flow, scheduler = make(CONFIG)
    produce(flow, 8)
    assert flow.paused
    controller.unregister("r")
    assert scheduler.calls[-1] == ("resume", "r")
    produce(flow, 50)  # no longer watched
    assert scheduler.calls.count(("pause", "r")) == 1


async def test_the_monitor_wakes_only_while_a_stream_is_registered(monkeypatch: Any) -> None:
    """An idle server's flow monitor sleeps until a stream comes (it polled every 20 ms)."""
    import asyncio

    from sluicegate.stream import flow as flow_module

    sleeps: list[float] = []

    class CountedSleeps:
        """The flow module's ``asyncio``, its sleeps counted."""

        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        async def sleep(self, seconds: float) -> None:
            sleeps.append(seconds)
            await asyncio.sleep(seconds)

    monkeypatch.setattr(flow_module, "asyncio", CountedSleeps())
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000, seed=1))
    controller = FlowController(FlowConfig(check_interval_seconds=0.01), FakeScheduler({}))
    controller.start()
    await asyncio.sleep(0.2)  # twenty of its intervals
    assert sleeps == []
    controller.register(StreamFlow(RequestStream("r"), request))
    deadline = time.monotonic() + 30
    while not sleeps:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    controller.unregister("r")
    await asyncio.sleep(0.1)
    polled = len(sleeps)
    await asyncio.sleep(0.2)
    assert len(sleeps) == polled
    await controller.stop()
