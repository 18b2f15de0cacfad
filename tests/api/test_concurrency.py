"""Many streams at once (in process), and disconnects (through a real server: what a
closed socket does is the point)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.simtext import expected_chat
from tests.support.inprocess import InProcessApp, serve_in_process, wait_until
from tests.support.servers import ServerProcess, cancellations, start_server

MODEL = "sluicegate-sim"


@pytest.fixture(scope="module")
def sim_server() -> Iterator[ServerProcess]:
    """The sim engine at ~1 ms per step, with fixed limits only: every request is
    admitted, so that each one the tests send is one they can count."""
    server = start_server(
        [
            "--engine",
            "sim",
            "--sim-step-base-ms",
            "1",
            "--sim-step-per-token-ms",
            "0.01",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "256",
            "--max-model-len",
            "1024",
            "--admission",
            "static",
        ],
        "concurrency",
    )
    yield server
    server.stop()


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, object]:
    """Wait until no request is running, waiting or otherwise alive (a detached stream
    in its grace period, a preempted sequence); the stats then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if (
            stats["requests_running"] == 0
            and stats["requests_waiting"] == 0
            and stats["live_requests"] == 0
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: {stats}")
        time.sleep(0.05)


async def test_100_concurrent_streams_each_get_their_own_text() -> None:
    # Static admission: 100 at once on 64 seats, the rest queued; none refused.
    settings = {"max_num_seqs": 64, "max_num_batched_tokens": 256, "max_model_len": 1024}
    async with serve_in_process(admission="static", **settings) as app:
        client = app.openai(max_retries=0)

        async def one(i: int) -> tuple[int, str, list[dict[str, str]]]:
            messages = [{"role": "user", "content": f"stream number {i}"}]
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=64,
                seed=1000 + i,  # type: ignore[arg-type]
                stream=True,
            )
            text = ""
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return i, text, messages

        results = await asyncio.gather(*(one(i) for i in range(100)))
        for i, text, messages in results:
            assert text == expected_chat(messages, 1000 + i, 64), f"stream {i}"
        await wait_until(functools.partial(idle, app), "every request to end")
        assert (await app.stats())["kv_cache"]["used_blocks"] == 0


async def test_a_stream_outlives_a_stall_past_its_lease() -> None:
    """The replica stalls longer than the lease's TTL (a machine busy with other work, a
    long pause of the process): nobody took its streams meanwhile, so they go on, whole,
    instead of ending in "another replica continues this stream"."""
    settings = {"sim_step_base_ms": 5.0, "lease_ttl_seconds": 0.2}  # 200 tokens: ~1 s
    async with serve_in_process(admission="static", **settings) as app:
        client = app.openai(max_retries=0)
        messages = [{"role": "user", "content": "a stall"}]
        assert app.state.ready is not None
        sessions = app.state.ready.sessions

        async def stall() -> None:
            # Once the stream has logged a few events (this client reads it only whole).
            await wait_until(lambda: any(s.last_seq >= 3 for s in sessions), "events")
            time.sleep(0.5)  # noqa: ASYNC251 -- the point: the loop stalls, no renewal for 2.5 TTLs

        stalling = asyncio.create_task(stall())
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, seed=7, stream=True
        )  # type: ignore[call-overload]
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        await stalling
        assert text == expected_chat(messages, 7, 200)
        reclaimed = (await app.metrics()).total("sluicegate_stream_leases_reclaimed_total")
        assert reclaimed >= 1


async def idle(app: InProcessApp) -> bool:
    return (await app.stats())["live_requests"] == 0


async def test_disconnect_aborts_generation(sim_server: ServerProcess) -> None:
    wait_idle(sim_server)
    cancelled_before = cancellations(sim_server)
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(10):
            body = {
                "model": MODEL,
                "prompt": "long one",
                "max_tokens": 1000,
                "stream": True,
                "ignore_eos": True,
            }
            async with client.stream("POST", sim_server.v1 + "/completions", json=body) as resp:
                n = 0
                async for _line in resp.aiter_lines():
                    n += 1
                    if n > 5:
                        break
    # Streams of 1000 tokens at ~1 ms a step or more: each was still running when its
    # client left, and was aborted then (counted as a cancellation), not finished.
    stats = wait_idle(sim_server)
    assert stats["kv_cache"]["used_blocks"] == 0  # type: ignore[index]
    assert cancellations(sim_server) - cancelled_before == 10


async def test_non_streaming_disconnect_aborts(sim_server: ServerProcess) -> None:
    wait_idle(sim_server)
    cancelled_before = cancellations(sim_server)
    # 1000 tokens at 1 ms a step or more: the client gives up reading first.
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    timeout = httpx.Timeout(30.0, read=0.2)
    async with httpx.AsyncClient(timeout=timeout) as client:
        with contextlib.suppress(httpx.ReadTimeout):
            await client.post(sim_server.v1 + "/completions", json=body)
    wait_idle(sim_server)
    assert cancellations(sim_server) - cancelled_before == 1


async def test_200_disconnects_leak_nothing(sim_server: ServerProcess) -> None:
    before = wait_idle(sim_server)
    cancelled_before = cancellations(sim_server)

    async def one(i: int) -> None:
        """Admitted (running or queued), it hangs up mid-stream."""
        body = {
            "model": MODEL,
            "prompt": f"leak {i}",
            "max_tokens": 500,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", sim_server.v1 + "/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            n = 0
            async for _line in resp.aiter_lines():
                n += 1
                if n > 3 + i % 5:
                    break

    await asyncio.gather(*(one(i) for i in range(200)))
    after = wait_idle(sim_server)
    assert after["kv_cache"]["used_blocks"] == 0  # type: ignore[index]
    assert after["live_requests"] == 0
    assert after["streams_paused"] == 0
    # Every per-request task is gone (the same fixed set of server tasks as before).
    assert after["event_loop_tasks"] <= before["event_loop_tasks"]
    assert cancellations(sim_server) - cancelled_before == 200
