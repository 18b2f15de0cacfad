"""Shared fixtures: a real server process on a free port, talked to over real sockets.

The server process itself is :mod:`sluicegate.bench.server_process` (the bench starts
its servers the same way); here each server's log goes to ``test-artifacts/``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from sluicegate.bench.server_process import ServerProcess, free_port, start_server_with_args

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def start_server(
    args: list[str],
    name: str,
    ready_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """``sluicegate serve`` with ``args`` on a free port, logging to
    ``test-artifacts/server-<name>-<port>.log``; returns once it is ready.

    Stop it with :meth:`ServerProcess.stop`.
    """
    port = free_port()
    return start_server_with_args(
        args,
        ARTIFACTS / f"server-{name}-{port}.log",
        port=port,
        ready_timeout_seconds=ready_timeout,
        env=env,
        preexec_fn=preexec_fn,
    )


def cancellations(server: ServerProcess) -> float:
    """The server's ``sluicegate_cancellations_total``: sequences aborted because their
    client disconnected or cancelled (each counted once)."""
    return server.metrics().total("sluicegate_cancellations_total")


@pytest.fixture(scope="session")
def sim_server() -> Iterator[ServerProcess]:
    """The sim engine at ~1 ms per step: fast enough for many tests, slow enough to overlap."""
    server = start_server(
        [
            "--engine", "sim", "--sim-step-base-ms", "1", "--sim-step-per-token-ms", "0.01",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
        ],
        "sim",
    )  # fmt: skip
    yield server
    server.stop()


# --------------------------------------------------------------------------------------
# Tools that pip does not install (redis-server, Chromium)

#: The skip reason of each missing tool: every test it skips shares one summary line.
_missing_tool_reasons: set[str] = set()


def skip_unless_installed(installed: bool, tool: str, install: str) -> None:
    """Skip the calling test (or fixture) when ``tool`` is not installed, saying how to
    install it: ``redis-server not installed: apt-get install redis-server``."""
    if installed:
        return
    reason = f"{tool} not installed: {install}"
    _missing_tool_reasons.add(reason)
    pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Report every skip for a missing tool at one location, so that ``-ra`` folds them
    into one line per tool instead of one per test."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        _, _, message = report.longrepr
        if message.removeprefix("Skipped: ") in _missing_tool_reasons:
            report.longrepr = (__file__, skip_unless_installed.__code__.co_firstlineno, message)
    return report


@pytest.fixture(scope="session")
def torch_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted SmolLM2 weights, shared by every test that loads the model (converting
    the GGUF takes seconds; each conversion is tested where the cache is)."""
    return tmp_path_factory.mktemp("sluicegate-torch-cache")
