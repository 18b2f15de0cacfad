"""Shared fixtures, and the rule that a test that starts a process or loads the model is
``slow`` (:mod:`tests.support.slow_rule`).

API behaviour is tested in process (:mod:`tests.support.inprocess`); a real server
process (:mod:`tests.support.servers`) where only sockets and processes show it.
"""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import signal
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import cpu_usage, order, slow_rule
from tests.support.model_server import (
    READY_TIMEOUT_SECONDS,
    awake,
    model_server_args,
    wait_calibrated,
)
from tests.support.servers import ServerProcess, start_server

_guard = slow_rule.ProcessGuard()

# Under pytest-xdist (make test: three workers on two cores), each worker's torch, and that
# of the servers it starts, computes on one thread: the workers' threads spinning for the
# same cores slowed the model's tests several times over.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("SLUICEGATE_TORCH_THREADS", "1")

# The compiled decode step is the product's default, but its build takes minutes of CPU
# for the full model: servers the tests start decode eagerly unless they ask for it
# (tests/engine/torch/test_compiled.py builds it for a one-layer cut of the model).
os.environ.setdefault("SLUICEGATE_ENGINE_COMPILE", "off")

# Torch Inductor's cache (the compiled decode step's build, ~230 MB a run) in a directory
# of this process's own, removed at its end: in its default place
# (/tmp/torchinductor_<user>) every run left its build behind for good (28 GB here), and
# a later run found a warm cache that CI's fresh machine never has.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="sluicegate-test-inductor-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_CACHE)
# ... so each build would probe the CPU's vector instruction sets again (a small program
# built and loaded for each of four, ~9 s of CPU of a 40 s build), which the product
# does once a machine (the probe's builds stay in its cache). Inductor trusts the flags
# /proc/cpuinfo lists instead: on this machine it picks the same one (avx512 with VNNI
# and AMX) either way.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)


def _exit_at_once() -> None:
    """A pytest-xdist worker's last exit handler: its reports are sent and its files
    closed by now, and what is left is the interpreter freeing every object of torch, the
    server and the client libraries one by one: 1.5-4 s of each worker's end (three
    workers on two cores, at once), which the run waited for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Registered first, so run last: after every handler that modules imported later add.
if os.environ.get("PYTEST_XDIST_WORKER"):
    atexit.register(_exit_at_once)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_rule.mark(items)
    if unmarked := slow_rule.unmarked_slow_modules(items, config):
        raise pytest.UsageError(
            "every test of these modules is slow: mark each slow as a whole "
            "(pytestmark = pytest.mark.slow) so that a fast run does not import it: "
            + ", ".join(unmarked)
        )
    order.check_groups(items)
    order.longest_files_first(items)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Files that share an expensive session fixture run on one worker (order.GROUPS)."""
    return order.make_scheduler(config, log)


def _fast_run(config: pytest.Config) -> bool:
    """Whether this run deselects slow tests (``make test-fast``)."""
    return config.getoption("markexpr", "").replace(" ", "") in ("notslow", "not(slow)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # A run without slow tests does not import the modules that are slow as a whole
    # (the clients' libraries take seconds to import; their tests would all be
    # deselected anyway).
    if _fast_run(config) and slow_rule.slow_module(collection_path):
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    # Only where slow tests are deselected: there no test may start a process.
    if _fast_run(config):
        # The standard library asks `uname -p` once per process, the first time anyone
        # wants the processor's name (the openai client's platform headers do): ask now.
        platform.processor()
        _guard.install()


#: ``SLUICEGATE_TEST_CPU=<file>``: each test's CPU, its servers' included (cpu_usage.py).
_cpu = cpu_usage.recorder()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    _guard.test = item.nodeid
    if _cpu is not None:
        _cpu.start()
    try:
        return (yield)
    finally:
        _guard.test = None
        if _cpu is not None:
            _cpu.stop(item.nodeid)


@pytest.fixture(scope="session")
def sim_server() -> Iterator[ServerProcess]:
    """The sim engine at ~1 ms per step: fast enough for many tests, slow enough to overlap."""
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
        ],
        "sim",
    )
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
    """Converted SmolLM2 weights and the cost model's saved calibration, shared by every
    test that loads the model, and by the run's pytest-xdist workers (converting the GGUF
    takes about 10 s of CPU, calibrating a server 4-5 s: once a run each, not once a
    worker). Each entry is written to a temporary name and renamed, so two workers that
    convert at once both leave a whole file. A new directory each run: the cold path is
    exercised every time (each conversion is tested where the cache is)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's own directory, above each worker's
    path = root / "sluicegate-torch-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_server_process(
    torch_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """SmolLM2 through a real server, one per session, so one per pytest-xdist worker,
    started by the first file that asks for it (:mod:`tests.support.model_server`).
    Tests take :func:`model_server`."""
    journal = tmp_path_factory.mktemp("model-server") / "jobs.sqlite3"
    server = start_server(
        model_server_args(torch_cache_dir, journal), "smollm2", ready_timeout=READY_TIMEOUT_SECONDS
    )
    wait_calibrated(server)
    yield server
    server.process.send_signal(signal.SIGCONT)  # paused, it would not hear SIGTERM
    server.stop()


@pytest.fixture(scope="module")
def model_server(model_server_process: ServerProcess) -> Iterator[ServerProcess]:
    """The session's SmolLM2 server, shared by every file that asks it for answers:
    running while this file's tests use it, paused between such files."""
    with awake(model_server_process) as server:
        yield server
