"""Background jobs: 202 at once, journaled, exactly once across a SIGKILL."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import start_server
from tests.simtext import expected_completion

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
            body = {"model": MODEL, "prompt": f"job {i}", "max_tokens": 30, "seed": i,
                    "ignore_eos": True, "background": True}  # fmt: skip
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
                j for j in jobs
                if httpx.get(f"{srv.v1}/jobs/{j}", timeout=5).json()["status"] == "done"
            ]  # fmt: skip
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
