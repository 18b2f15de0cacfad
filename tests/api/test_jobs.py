"""Background jobs: 202 at once, journaled, exactly once across a SIGKILL."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.simtext import expected_completion
from tests.support.servers import start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"


def test_background_jobs_survive_sigkill_exactly_once(tmp_path: Path) -> None:
    config = tmp_path / "jobs.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                "sim_step_base_ms": 10,
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
        deadline = time.monotonic() + 20
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

    srv2 = start_server(["--config", str(config)], "jobs-b")
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


def test_jobs_are_under_the_tenants_limits_and_journal_only_their_fields(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "jobs.sqlite3"
    config = tmp_path / "limited.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                "journal_path": str(journal),
                "tenants": [
                    {
                        "name": "five",
                        "api_key": "sk-five",
                        "requests_per_second": 5,
                        "tokens_per_minute": 100_000,
                    },
                ],
            }
        )
    )
    srv = start_server(["--config", str(config)], "jobs-limits")
    headers = {"authorization": "Bearer sk-five"}
    try:
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
        with httpx.Client(timeout=10) as client:
            for _ in range(40):
                response = client.post(srv.v1 + "/completions", json=body, headers=headers)
                statuses.append(response.status_code)
                if response.status_code == 429:
                    error = response.json()["error"]
                    assert error["type"] == "rate_limited_requests", error
                    assert "retry-after" in response.headers
        accepted = statuses.count(202)
        # A burst of 5, plus what 5/s refills while 40 requests are sent.
        assert 5 <= accepted <= 10, statuses
        assert statuses.count(429) == 40 - accepted, statuses
    finally:
        srv.stop()
    with sqlite3.connect(journal) as db:
        rows = [json.loads(body) for (body,) in db.execute("SELECT body_json FROM jobs")]
    assert len(rows) == accepted
    for row in rows:
        assert row == {
            "kind": "completion",
            "body": {"model": MODEL, "prompt": "a job", "max_tokens": 8, "ignore_eos": False},
        }
    assert journal.stat().st_size < 1_000_000
