"""Background jobs: 202 at once, journaled (in process), exactly once across a SIGKILL (a
real server process, killed)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import yaml

from tests.simtext import expected_completion
from tests.support.inprocess import serve_in_process
from tests.support.servers import start_server

MODEL = "sluicegate-sim"


def test_background_jobs_survive_sigkill_exactly_once(tmp_path: Path) -> None:
    config = tmp_path / "jobs.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                # 12 jobs of 30 tokens on 2 seats at 25 ms a step take this server 4.5 s;
                # it is killed after two (about 0.75 s).  The second one, at 1 ms a step,
                # finishes the rest at once.
                "sim_step_base_ms": 25,
                "max_num_seqs": 2,
                "queue_policy": "spill-to-disk",
                "max_background_jobs_in_memory": 2,
                "journal_path": str(tmp_path / "jobs.sqlite3"),
            }
        )
    )
    srv = start_server(["--config", str(config)], "jobs-a")
    jobs: dict[str, int] = {}
    try:
        for i in range(12):
            body = {
                "model": MODEL,
                "prompt": f"job {i}",
                "max_tokens": 30,
                "seed": i,
                "ignore_eos": True,
                "background": True,
            }
            resp = httpx.post(srv.v1 + "/completions", json=body, timeout=10)
            assert resp.status_code == 202, resp.text
            job = resp.json()
            assert job["object"] == "job" and job["status"] in ("queued", "running")
            jobs[job["id"]] = i
        bad = httpx.post(
            srv.v1 + "/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 0, "background": True},
            timeout=10,
        )
        assert bad.status_code == 400  # validated before it is journaled
        # Let a few finish, then kill the server hard while the rest wait on disk.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = [
                j
                for j in jobs
                if httpx.get(f"{srv.v1}/jobs/{j}", timeout=5).json()["status"] == "done"
            ]
            if len(done) >= 2:
                break
            time.sleep(0.05)
        assert 2 <= len(done) < len(jobs), "some, not all, jobs done before the kill"
    finally:
        srv.process.kill()
        srv.process.wait(10)

    srv2 = start_server(["--config", str(config), "--sim-step-base-ms", "1"], "jobs-b")
    try:
        deadline = time.monotonic() + 30
        views: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            views = {j: httpx.get(f"{srv2.v1}/jobs/{j}", timeout=5).json() for j in jobs}
            if all(v["status"] == "done" for v in views.values()):
                break
            time.sleep(0.1)
        for job_id, i in jobs.items():
            view = views[job_id]
            assert view["status"] == "done", view
            result = view["result"]
            assert isinstance(result, dict)
            assert result["choices"][0]["text"] == expected_completion(f"job {i}", i, 30)
        unknown = httpx.get(f"{srv2.v1}/jobs/job-nope", timeout=5)
        assert unknown.status_code == 404
    finally:
        srv2.stop()


async def test_jobs_are_under_the_tenants_limits_and_journal_only_their_fields(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "jobs.sqlite3"
    tenant = {
        "name": "five",
        "api_key": "sk-five",
        # A burst of 5, then one request every 100 s: nothing refills while the test runs.
        "requests_per_second": 0.01,
        "request_burst": 5,
        "tokens_per_minute": 100_000,
    }
    headers = {"authorization": "Bearer sk-five"}
    junk = "j" * 300_000  # three of them: just under max_request_body_bytes
    body = {
        "model": MODEL,
        "prompt": "a job",
        "max_tokens": 8,
        "background": True,
        "junk": junk,
        "user": junk,
        "metadata": {"junk": junk},
    }
    statuses = []
    async with serve_in_process(journal_path=str(journal), tenants=[tenant]) as app:
        for _ in range(40):
            response = await app.client.post("/v1/completions", json=body, headers=headers)
            statuses.append(response.status_code)
            if response.status_code == 429:
                error = response.json()["error"]
                assert error["type"] == "rate_limited_requests", error
                assert "retry-after" in response.headers
    # The burst of 5, and nothing more.
    assert statuses == [202] * 5 + [429] * 35, statuses
    with sqlite3.connect(journal) as db:
        rows = [json.loads(body) for (body,) in db.execute("SELECT body_json FROM jobs")]
    assert len(rows) == 5
    for row in rows:
        assert row == {
            "kind": "completion",
            "body": {"model": MODEL, "prompt": "a job", "max_tokens": 8, "ignore_eos": False},
        }
    assert journal.stat().st_size < 1_000_000
