"""Many streams at once, and disconnects, through the real server."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import pytest

from tests.simtext import expected_chat
from tests.support.servers import ServerProcess, cancellations

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, object]:
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


async def test_100_concurrent_streams_each_get_their_own_text(sim_server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=sim_server.v1, api_key="unused", max_retries=0)

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
    await client.close()
    for i, text, messages in results:
        assert text == expected_chat(messages, 1000 + i, 64), f"stream {i}"
    stats = wait_idle(sim_server)
    assert stats["kv_cache"]["used_blocks"] == 0  # type: ignore[index]


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
    # Streams of 1000 tokens at ~1 ms a step would still be running after the loop;
    # disconnects must have aborted them.
    stats = wait_idle(sim_server, timeout=2.0)
    assert stats["kv_cache"]["used_blocks"] == 0  # type: ignore[index]
    assert cancellations(sim_server) - cancelled_before == 10


async def test_non_streaming_disconnect_aborts(sim_server: ServerProcess) -> None:
    wait_idle(sim_server)
    cancelled_before = cancellations(sim_server)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=0.2) as client:
        with contextlib.suppress(httpx.TimeoutException):
            await client.post(sim_server.v1 + "/completions", json=body)
    wait_idle(sim_server, timeout=2.0)
    assert cancellations(sim_server) - cancelled_before == 1


async def test_200_disconnects_leak_nothing(sim_server: ServerProcess) -> None:
    before = wait_idle(sim_server)
    cancelled_before = cancellations(sim_server)

    async def one(i: int) -> bool:
        """True if admitted (then it hangs up mid-stream); refused by objective otherwise."""
        body = {
            "model": MODEL,
            "prompt": f"leak {i}",
            "max_tokens": 500,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=10) as client,
            client.stream("POST", sim_server.v1 + "/completions", json=body) as resp,
        ):
            if resp.status_code == 429:  # admission by objective: refused at once, no work
                assert (await resp.aread()).find(b"slo_unreachable") > 0
                return False
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                if "slo_unreachable" in line:  # refused while queued: it ends, no cancel
                    return False
                n += 1
                if n > 3 + i % 5:
                    break
            return True

    admitted = sum(await asyncio.gather(*(one(i) for i in range(200))))
    assert admitted >= 64  # every seat, at least
    after = wait_idle(sim_server, timeout=5.0)
    assert after["kv_cache"]["used_blocks"] == 0  # type: ignore[index]
    assert after["live_requests"] == 0
    assert after["streams_paused"] == 0
    # Every per-request task is gone (the same fixed set of server tasks as before).
    assert after["event_loop_tasks"] <= before["event_loop_tasks"]
    assert cancellations(sim_server) - cancelled_before == admitted
