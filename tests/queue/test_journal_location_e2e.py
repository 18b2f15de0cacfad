"""The job journal through the served app: starts leave one file in the cache, not one
each.  In process: the journal is claimed when the app starts and released when it stops
(its lifespan), which is what a server process does around it."""

from __future__ import annotations

from pathlib import Path

from tests.support.inprocess import serve_in_process


async def test_server_starts_leave_one_journal_in_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for _ in range(2):  # two starts, one after the other
        async with serve_in_process(cache_dir=str(cache)) as app:
            job = await app.client.post(
                "/v1/completions",
                json={
                    "model": "sluicegate-sim",
                    "prompt": "x",
                    "max_tokens": 2,
                    "background": True,
                },
            )
            assert job.status_code == 202
    journals = sorted(p.name for p in cache.iterdir() if ".sqlite3" in p.name)
    assert journals == ["jobs.sqlite3", "jobs.sqlite3.lock"], journals
