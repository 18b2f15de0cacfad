"""Upstream mode against real servers on free ports: other ``sluicegate serve --engine
sim`` processes are the upstreams (fast, in every run), and a gateway fronts them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import plain_http
from tests.support.servers import ServerProcess, start_server

#: A sim upstream whose answers take a while (5 ms steps), so streams overlap.
SLOW_SIM = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "5",
    "--sim-step-per-token-ms",
    "0.01",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "2048",
    "--admission",
    "static",
]
#: A gateway that notices failures fast.
GATEWAY = [
    "--engine",
    "upstream",
    "--upstream-health-interval-seconds",
    "0.5",
    "--upstream-first-token-timeout-seconds",
    "3",
    "--upstream-idle-timeout-seconds",
    "3",
]

#: A gateway for paused readers: small buffers, so a reader that stops is seen at once.
PAUSE = [
    "--pause-preempt-seconds",
    "0.5",
    "--high-water-tokens",
    "32",
    "--low-water-tokens",
    "8",
    "--flush-interval-ms",
    "0",
    "--socket-send-buffer-bytes",
    "4096",
    "--transport-write-buffer-bytes",
    "4096",
    "--stall-timeout-seconds",
    "60",
]


def upstream_cancelled(upstream: ServerProcess) -> float:
    """Requests the upstream itself ended as cancelled (its client, the gateway, went
    away), whether it dropped them at once or after keeping them resumable a while."""
    return plain_http.metrics(upstream).total('sluicegate_requests_total{status="cancelled"}')


def start_upstream(name: str, *extra: str) -> ServerProcess:
    """A sim upstream (:data:`SLOW_SIM`, then ``extra``), forked
    (:mod:`tests.support.forked`)."""
    return start_server([*SLOW_SIM, *extra], f"upstream-{name}")


def start_gateway(upstreams: list[ServerProcess], name: str, *extra: str) -> ServerProcess:
    """A gateway (:data:`GATEWAY`, then ``extra``) in front of ``upstreams``, forked."""
    args = [*GATEWAY, *extra]
    for upstream in upstreams:
        args += ["--upstream", upstream.base_url]
    return start_server(args, f"gateway-{name}")


@pytest.fixture(scope="package")
def upstream_a() -> Iterator[ServerProcess]:
    server = start_upstream("a")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def gateway(upstream_a: ServerProcess) -> Iterator[ServerProcess]:
    """A gateway in front of ``upstream_a``, with the default (SmolLM2) tokenizer."""
    server = start_gateway([upstream_a], "a")
    yield server
    server.stop()
