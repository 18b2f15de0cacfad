"""Two gateways sharing one real Redis in front of one upstream: a gateway killed
mid-stream, and the client's resume on the other gateway continues the answer from the
upstream, with no event lost or repeated."""

from __future__ import annotations

import pytest

from tests.resume.conftest import (
    assert_continues,
    completion_body,
    kill,
    owner,
    read_stream,
    resume,
)
from tests.resume.conftest import redis_url as redis_url  # the session's Redis fixture
from tests.support.servers import ServerProcess, start_server
from tests.upstream.conftest import GATEWAY

pytestmark = pytest.mark.slow


def gateway(upstream: ServerProcess, redis: str, name: str) -> ServerProcess:
    return start_server(
        [
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
        ],
        f"gateway-{name}",
    )


def test_a_killed_gateway_s_stream_continues_on_another(
    redis_url: str, upstream_a: ServerProcess
) -> None:
    doomed, other = gateway(upstream_a, redis_url, "doomed"), gateway(upstream_a, redis_url, "b")
    try:
        n = 500  # 2.5 s of the upstream's 5 ms steps
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
    finally:
        doomed.stop()
        other.stop()
