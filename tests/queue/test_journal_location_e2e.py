"""The job journal through real servers: starts leave one file in the cache, not one each."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.servers import start_server

pytestmark = pytest.mark.slow


def test_server_starts_leave_one_journal_in_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["--engine", "sim", "--cache-dir", str(cache)]
    for run in range(2):  # two starts, each on its own free port
        server = start_server(args, f"journal-{run}")
        try:
            job = httpx.post(
                server.v1 + "/completions",
                json={
                    "model": "sluicegate-sim",
                    "prompt": "x",
                    "max_tokens": 2,
                    "background": True,
                },
                timeout=5,
            )
            assert job.status_code == 202
        finally:
            assert server.stop() == 0
    journals = sorted(p.name for p in cache.iterdir() if ".sqlite3" in p.name)
    assert journals == ["jobs.sqlite3", "jobs.sqlite3.lock"], journals
