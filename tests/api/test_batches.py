"""The Batch API through the official ``openai`` client: files in, a batch run on idle
capacity, results out; per-tenant ownership (in process); every line answered exactly
once across a SIGKILL (a real server process, killed)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import yaml

from tests.simtext import expected_completion
from tests.support.inprocess import serve_in_process, wait_until
from tests.support.servers import ServerProcess, start_server

MODEL = "sluicegate-sim"
TENANTS = [{"name": "alpha", "api_key": "sk-alpha"}, {"name": "beta", "api_key": "sk-beta"}]


def batch_settings(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "engine": "sim",
        "sim_step_base_ms": 2,
        "max_num_seqs": 4,
        "journal_path": str(tmp_path / "jobs.sqlite3"),
        **extra,
    }


def config(tmp_path: Path, **extra: Any) -> str:
    path = tmp_path / "batches.yaml"
    path.write_text(yaml.safe_dump(batch_settings(tmp_path, **extra)))
    return str(path)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def completion_line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": MODEL,
            "prompt": f"line {i}",
            "max_tokens": 12,
            "seed": i,
            "ignore_eos": True,
            **body,
        },
    }


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=30)


def wait_for_batch(api: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "expired", "failed"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


async def batch_done(api: openai.AsyncOpenAI, batch_id: str) -> Any:
    """The batch once it has ended (generous deadline: only a broken server misses it)."""
    ended = ("completed", "cancelled", "expired", "failed")

    async def has_ended() -> bool:
        return (await api.batches.retrieve(batch_id)).status in ended

    await wait_until(has_ended, f"batch {batch_id} to end", within_seconds=60)
    return await api.batches.retrieve(batch_id)


def by_custom_id(text: str) -> dict[str, dict[str, Any]]:
    lines = [orjson.loads(line) for line in text.splitlines() if line]
    found = {line["custom_id"]: line for line in lines}
    assert len(found) == len(lines), "a custom_id answered twice"
    return found


async def test_a_batch_runs_through_the_official_client(tmp_path: Path) -> None:
    async with serve_in_process(**batch_settings(tmp_path, tenants=TENANTS)) as app:
        alpha, beta = app.openai("sk-alpha", max_retries=0), app.openai("sk-beta", max_retries=0)
        lines = [completion_line(i) for i in range(20)]
        lines.append(completion_line(20, temperature=9.0))  # the line's own error
        uploaded = await alpha.files.create(file=("nightly.jsonl", jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.filename == "nightly.jsonl"
        batch = await alpha.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"run": "nightly"},
        )
        assert batch.status == "in_progress" and batch.request_counts.total == 21
        assert batch.metadata == {"run": "nightly"}
        done = await batch_done(alpha, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (20, 1)
        assert done.output_file_id is not None and done.error_file_id is not None
        output = by_custom_id((await alpha.files.content(done.output_file_id)).text)
        assert set(output) == {f"req-{i}" for i in range(20)}
        for i in range(20):
            response = output[f"req-{i}"]["response"]
            assert response["status_code"] == 200
            text = response["body"]["choices"][0]["text"]
            assert text == expected_completion(f"line {i}", i, 12)
        errors = by_custom_id((await alpha.files.content(done.error_file_id)).text)
        bad = errors["req-20"]["response"]
        assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
        assert [b.id async for b in alpha.batches.list()] == [batch.id]
        assert {f.purpose async for f in alpha.files.list()} == {"batch", "batch_output"}
        # Another tenant sees none of it.
        with pytest.raises(openai.NotFoundError):
            await beta.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            await beta.files.content(done.output_file_id)
        assert [b async for b in beta.batches.list()] == []
        assert [f async for f in beta.files.list()] == []
        # Bad files are refused at once, naming the line.
        repeated = jsonl([completion_line(1), completion_line(1)])
        with pytest.raises(openai.BadRequestError, match="line 2 repeats the custom_id"):
            await alpha.files.create(file=("bad.jsonl", repeated), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="line 1 is not JSON"):
            await alpha.files.create(file=("bad.jsonl", b"{nope\n"), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await alpha.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await alpha.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/completions",
                completion_window="1h",  # type: ignore[arg-type]
            )
        await alpha.files.delete(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            await alpha.files.retrieve(uploaded.id)


async def test_a_cancelled_batch_stops_taking_lines(tmp_path: Path) -> None:
    # 20 ms a step: the 200 lines would take 20 s, the cancel comes after two.
    settings = batch_settings(tmp_path, sim_step_base_ms=20, max_background_jobs_in_memory=2)
    async with serve_in_process(**settings) as app:
        api = app.openai(max_retries=0)
        lines = [completion_line(i, max_tokens=20) for i in range(200)]
        uploaded = await api.files.create(file=("big.jsonl", jsonl(lines)), purpose="batch")
        batch = await api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )

        async def two_completed() -> bool:
            return (await api.batches.retrieve(batch.id)).request_counts.completed >= 2

        await wait_until(two_completed, "two lines done")
        cancelling = await api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await batch_done(api, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        counts = done.request_counts
        assert 2 <= counts.completed < 200 and counts.total == 200
        output = by_custom_id((await api.files.content(done.output_file_id or "")).text)
        assert len(output) == counts.completed

        async def nothing_runs() -> bool:
            return (await app.stats())["requests_running"] == 0

        await wait_until(nothing_runs, "the cancelled lines to leave the engine")


def test_every_line_is_answered_once_across_a_sigkill(tmp_path: Path) -> None:
    # The first server at 25 ms a step: 60 lines of 12 tokens, three at a time, take it
    # 6 s, and it is killed after 5 (about 0.6 s).  The second one, at 1 ms a step,
    # finishes the rest at once.
    settings = config(tmp_path, sim_step_base_ms=25, max_background_jobs_in_memory=3)
    first = start_server(["--config", settings], "batch-kill-a")
    lines = [completion_line(i) for i in range(60)]
    try:
        api = client(first, "none")
        uploaded = api.files.create(file=("kill.jsonl", jsonl(lines)), purpose="batch")
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 30
        while (completed := api.batches.retrieve(batch.id).request_counts.completed) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert completed < 60, "killed while lines were still to run"
    finally:
        first.process.kill()
        first.process.wait(10)
    second = start_server(["--config", settings, "--sim-step-base-ms", "1"], "batch-kill-b")
    try:
        api = client(second, "none")
        done = wait_for_batch(api, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 60
        output = by_custom_id(api.files.content(done.output_file_id or "").text)
        assert set(output) == {f"req-{i}" for i in range(60)}
        for i in (0, 30, 59):
            text = output[f"req-{i}"]["response"]["body"]["choices"][0]["text"]
            assert text == expected_completion(f"line {i}", i, 12)
    finally:
        second.stop()
