"""The clients people use, unmodified and with their default settings, against a real
``sluicegate serve --engine sim`` on a free port: one server per test module (the
official client's modules also through a gateway in front of one).

No client here may reach the network: the machine has none, and a client that tries
would hang a test until its timeout. Their telemetry and price-list downloads are off
before any of them is imported (conftest modules are imported before test modules).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.support.servers import ServerProcess, start_server

#: LangSmith tracing (LangChain) stays off; so do litellm's model-cost map download at
#: import and anything else it fetches on its own (offline mode: its bundled copies).
_NO_NETWORK = {
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_OFFLINE_MODE": "true",
    # The OpenAI Agents SDK exports its traces to api.openai.com unless told not to.
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
}
for _name, _value in _NO_NETWORK.items():
    os.environ.setdefault(_name, _value)

#: The sim engine at ~1 ms a step, answers of up to 1,024 tokens.
SIM_ARGS = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "1",
    "--sim-step-per-token-ms",
    "0.01",
    "--max-num-seqs",
    "16",
    "--max-model-len",
    "2048",
    "--admission",
    "static",
]


@pytest.fixture(scope="module")
def sim() -> Iterator[ServerProcess]:
    """A sim server for this module's tests."""
    server = start_server(SIM_ARGS, "clients-sim")
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["direct", "gateway"])
def served(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A sim server, then a gateway (``--engine upstream``) in front of one: what a client
    sees must not depend on which it talks to."""
    with ExitStack() as stack:
        upstream = start_server(SIM_ARGS, "clients-sim")
        stack.callback(upstream.stop)
        if request.param == "direct":
            yield upstream
            return
        gateway = start_server(
            ["--engine", "upstream", "--upstream", upstream.base_url, "--admission", "static"],
            "clients-gateway",
        )
        stack.callback(gateway.stop)
        yield gateway
