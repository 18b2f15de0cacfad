"""The service in process, on the simulated engine: every way a request's life can end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from sluicegate.admission.tenants import Tenant
from sluicegate.config import load_settings
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.queue.ticket import TicketState
from sluicegate.scheduler.request import FinishReason, SamplingParams
from sluicegate.service.collect import collect
from sluicegate.service.generation import Generation, Life
from sluicegate.service.service import Service

TENANT = Tenant("default")


@pytest.fixture
async def make_service() -> AsyncIterator[Callable[..., Awaitable[Service]]]:
    services: list[Service] = []

    async def make(**settings: Any) -> Service:
        # Static admission: these tests queue on purpose, which admission by objective
        # would refuse (its own tests are tests/admission and tests/queue).
        settings = {"admission": "static", **settings}
        config = load_settings(
            engine="sim", sim_step_base_ms=2.0, sim_step_per_token_ms=0.0, **settings
        )
        service = await Service.load(config, Metrics("sim"))
        services.append(service)
        return service

    yield make
    for service in services:
        await service.close()


async def submit(service: Service, rid: str, max_tokens: int) -> Generation:
    sampling = SamplingParams(max_tokens=max_tokens, seed=3, ignore_eos=True)
    return await service.submit(TENANT, None, rid, [1, 2, 3, 4], sampling)


def counter(service: Service, name: str, *labels: str) -> float:
    metric = getattr(service.metrics, name)
    value: float = (metric.labels(*labels) if labels else metric)._value.get()
    return value


async def until(condition: Callable[[], bool], within_seconds: float = 5.0) -> None:
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_request_completes_once_and_lets_go_of_everything(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service = await make_service()
    generation = await submit(service, "a", 20)
    output, _ = await collect(service, generation, None)
    assert output.finish_reason == FinishReason.LENGTH and output.num_output_tokens == 20
    assert generation.life is Life.COMPLETED
    assert generation.ticket is not None and generation.ticket.state is TicketState.CLOSED
    assert not service.generations
    assert counter(service, "requests_total", "length") == 1
    assert counter(service, "cancellations_total") == 0
    await until(lambda: service.core.capacity.num_holding == 0)
    service.cancel(generation)  # ended already: nothing happens
    assert counter(service, "cancellations_total") == 0


async def test_cancelling_a_running_request_aborts_it_and_counts_it(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service = await make_service()
    generation = await submit(service, "long", 2000)
    await asyncio.wait_for(generation.stream.wait(), 5.0)
    service.cancel(generation)
    assert generation.life is Life.CANCELLED
    assert counter(service, "cancellations_total") == 1
    assert counter(service, "requests_total", "cancelled") == 1
    await until(lambda: generation.stream.finished)
    await until(lambda: service.core.capacity.num_holding == 0)
    assert generation.request.finish_reason == FinishReason.ABORT


async def test_cancelling_a_queued_request_never_reaches_the_engine(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service = await make_service(max_num_seqs=1, max_num_batched_tokens=64)
    running = await submit(service, "running", 2000)
    queued = await submit(service, "queued", 5)
    assert queued.queued
    service.cancel(queued)
    assert queued.ticket is not None and queued.ticket.dispatched_at is None
    assert counter(service, "cancellations_total") == 1
    assert service.dispatcher.num_queued == 0
    service.cancel(running)


async def test_a_stopped_request_is_told_to_retry_elsewhere(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service = await make_service(max_num_seqs=1, max_num_batched_tokens=64)
    running = await submit(service, "running", 2000)
    queued = await submit(service, "queued", 5)
    service.stop(queued, "drained")  # still queued: its stream ends with an abort
    service.stop(running, "drained")
    for generation in (running, queued):
        with pytest.raises(APIError) as info:
            await collect(service, generation, None)
        assert info.value.status_code == 503 and info.value.code == "server_draining"
        assert generation.life is Life.STOPPED
    assert counter(service, "requests_total", "drained") == 2
    assert counter(service, "cancellations_total") == 0


async def one_running_one_to_expire(
    make_service: Callable[..., Awaitable[Service]],
) -> tuple[Service, Generation, Generation]:
    """One seat, held by a long answer; a second request queued behind it, refused once
    it has waited 0.1 s."""
    service = await make_service(
        max_num_seqs=1, max_num_batched_tokens=64, max_queue_wait_seconds=0.1
    )
    running = await submit(service, "running", 2000)
    late = await submit(service, "late", 5)
    return service, running, late


async def test_a_request_refused_after_queueing_gets_the_reason(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service, running, late = await one_running_one_to_expire(make_service)
    with pytest.raises(APIError) as info:
        await collect(service, late, None)
    assert info.value.status_code == 503 and "retry-after" in info.value.headers
    assert counter(service, "rejections_total", "queue_timeout") == 1
    assert late.life is Life.COMPLETED and counter(service, "requests_total", "refused") == 1
    service.cancel(running)


async def test_a_client_gone_before_reading_its_refusal_is_counted_once(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service, running, late = await one_running_one_to_expire(make_service)
    await until(lambda: late.ticket is not None and late.ticket.rejection is not None)
    service.cancel(late)  # its client left before it read the refusal waiting for it
    assert counter(service, "rejections_total", "queue_timeout") == 1
    assert counter(service, "cancellations_total") == 0
    assert late.life is Life.COMPLETED and counter(service, "requests_total", "refused") == 1
    service.cancel(running)
    assert counter(service, "cancellations_total") == 1


async def test_a_client_gone_while_waiting_for_a_full_queue_leaves_nothing_behind(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    service = await make_service(
        max_num_seqs=1, max_num_batched_tokens=64, max_queued_requests=1, queue_policy="block"
    )
    await submit(service, "running", 2000)
    await submit(service, "queued", 5)
    blocked = asyncio.create_task(submit(service, "blocked", 5))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert set(service.generations) == {"running", "queued"}
    assert service.admission.in_flight == 2  # the blocked one's admission was given back
    for generation in list(service.generations.values()):
        service.cancel(generation)


async def test_only_steps_in_which_a_sequence_decoded_count_for_the_breaker(
    make_service: Callable[..., Awaitable[Service]],
) -> None:
    """Long prefill steps on an idle server (a first prompt, ``/v1/prefill`` warm-ups)
    keep no stream waiting: the breaker's step signal leaves them out, and does not shed
    the warm-ups; the same steps beside decoding streams count."""
    from sluicegate.admission.breaker import BreakerState
    from sluicegate.engine.base import StepStats

    service = await make_service()
    breaker = service.dispatcher.breaker
    assert breaker is not None
    for _ in range(2 * breaker.config.min_samples):
        service._on_step(StepStats(3.0, 1, 512, num_decoding=0))
    await asyncio.sleep(0)  # the steps reach the event loop
    assert breaker.snapshot().p95_step_seconds is None
    assert breaker.evaluate() is BreakerState.CLOSED
    for _ in range(2 * breaker.config.min_samples):
        service._on_step(StepStats(3.0, 2, 513, num_decoding=1))
    await until(lambda: breaker.snapshot().p95_step_seconds == 3.0)
    assert breaker.evaluate() is not BreakerState.CLOSED
