"""Gateways sharing one real Redis in front of sim upstreams: a gateway killed
mid-stream, and the client's resume on another gateway continues the answer from the
upstream, with no event lost or repeated.  The module's gateways start together, those
that tests kill among them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.resume.conftest import (
    Event,
    assert_continues,
    completion_body,
    kill,
    owner,
    read_stream,
    resume,
)
from tests.resume.conftest import redis_url as redis_url  # the session's Redis fixture
from tests.support.servers import ServerProcess, start_servers
from tests.upstream.conftest import GATEWAY, start_upstream

pytestmark = pytest.mark.slow


def gateway_args(upstream: ServerProcess, redis: str) -> list[str]:
    return [
        *GATEWAY,
        "--upstream",
        upstream.base_url,
        "--store",
        f"{redis}/3",
        "--upstream-tokenizer",
        "bytes",
        "--lease-ttl-seconds",
        "1",
        "--detached-grace-seconds",
        "0.5",
        "--flush-interval-ms",
        "0",
    ]


@dataclass
class Gateways:
    """The module's gateways, sharing one Redis, started together."""

    #: In front of ``upstream_a``; no test stops them.
    one: ServerProcess
    two: ServerProcess
    #: In front of ``upstream_a``, killed mid-answer.
    doomed: ServerProcess
    #: In front of a sim upstream of 10 ms steps, killed mid-answer.
    doomed_tools: ServerProcess


@pytest.fixture(scope="module")
def gateways(redis_url: str, upstream_a: ServerProcess) -> Iterator[Gateways]:
    # 10 ms steps, a byte a step: the second of two tool calls takes over a second.
    slow = start_upstream("slow-tools", "--sim-step-base-ms", "10")
    args = gateway_args(upstream_a, redis_url)
    started = [slow]
    try:
        started += start_servers(
            (args, "gateway-one"),
            (args, "gateway-two"),
            (args, "gateway-doomed"),
            (gateway_args(slow, redis_url), "gateway-tdoomed"),
        )
        yield Gateways(*started[1:])
    finally:
        for server in started:
            server.stop()


def test_a_killed_gateway_s_stream_continues_on_another(gateways: Gateways) -> None:
    doomed, other = gateways.doomed, gateways.two
    n = 300  # 1.5 s of the upstream's 5 ms steps: over a second left after the cut
    body = completion_body("relay me", 5, n)
    first = read_stream("POST", doomed.v1 + "/completions", json=body, stop_after_events=40)
    assert first.status == 200, first.text
    kill(doomed)
    sid = first.headers["x-sluicegate-stream-id"]
    # The other gateway waits out the dead one's lease (1 s), then continues the answer
    # from the upstream with a continuation request.
    rest = resume(other, sid, first.last_event_id, headers=owner(first))
    assert rest.status == 200 and rest.done, rest.events[-3:]
    assert_continues(first, rest)
    text = first.text + rest.text
    # max_tokens (bytes) in all, less a last character the sim may cut mid-UTF-8.
    assert n - 3 <= len(text.encode()) <= n, len(text.encode())
    assert rest.text and "error" not in "".join(e.data for e in rest.events[-2:])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]
TOOL_BODY = {
    "model": "sluicegate-sim",
    "messages": [{"role": "user", "content": "weather and time?"}],
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": 300,
    "seed": 3,
    "stream": True,
}


def calls(events: list[Event]) -> list[dict[str, object]]:
    return [
        call
        for e in events
        if e.json is not None
        for choice in e.json.get("choices") or []
        for call in choice["delta"].get("tool_calls") or []
    ]


def test_a_tool_call_stream_replays_identically_on_another_gateway(gateways: Gateways) -> None:
    one, two = gateways.one, gateways.two
    whole = read_stream("POST", one.v1 + "/chat/completions", json=TOOL_BODY)
    assert whole.status == 200 and whole.done, whole.events[-3:]
    assert len(calls(whole.events)) == 2
    sid = whole.headers["x-sluicegate-stream-id"]
    first_id = whole.events[0].event_id
    again = resume(two, sid, first_id, headers=owner(whole))
    assert again.status == 200 and again.done
    # Every event after the first, as the first gateway sent it (the log's bytes).
    assert [(e.data, e.event_id) for e in again.events] == [
        (e.data, e.event_id) for e in whole.events[1:]
    ]


def test_a_tool_call_stream_taken_over_mid_answer_ends_clearly(gateways: Gateways) -> None:
    """A replica that takes over an answer that may hold tool calls cannot know which
    calls its client has: it ends the stream with a clear error, never a call twice.
    The gateway that dies fronts a sim of 10 ms steps, so it dies mid-answer; the one
    that takes over fronts another upstream, and asks none."""
    doomed, other = gateways.doomed_tools, gateways.two
    # The role chunk and the first call, whole; then the gateway dies.
    first = read_stream(
        "POST", doomed.v1 + "/chat/completions", json=TOOL_BODY, stop_after_events=2
    )
    assert first.status == 200 and len(calls(first.events)) == 1, first.events
    kill(doomed)
    sid = first.headers["x-sluicegate-stream-id"]
    rest = resume(other, sid, first.last_event_id, headers=owner(first))
    assert rest.status == 200 and rest.done, rest.events[-3:]
    assert_continues(first, rest)
    errors = [e.error for e in rest.events if e.error is not None]
    assert [e["code"] for e in errors] == ["upstream_answer_not_resumable"], rest.events
    assert calls(rest.events) == []
