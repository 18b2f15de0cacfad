"""A batch whose last lines end on several threads at once is finalized once (issue #31,
item 5): each line's end asks to finalize it, and before, several finalizers wrote the
same temporary output file, the losers failing with ``FileNotFoundError`` (or, reading
after the winner deleted the lines, writing a truncated file)."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson

from sluicegate.queue.batches import Batches
from sluicegate.queue.journal import JobJournal

LINES = 200


def test_concurrent_finalizers_write_the_output_once(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path / "jobs.sqlite3")
    store = Batches(journal, tmp_path / "files")
    requests = b"".join(
        orjson.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "x", "max_tokens": 1},
            }
        )
        + b"\n"
        for i in range(LINES)
    )
    source = store.add_file("t", "in.jsonl", "batch", requests)
    batch_id = store.create("t", source.file_id, "/v1/completions", "24h", None)["id"]
    while (job := journal.claim_next()) is not None:
        answer = {"status_code": 200, "body": {"id": job.job_id, "choices": [{"text": "y"}]}}
        journal.complete(job.job_id, orjson.dumps(answer).decode())
    start = threading.Barrier(8)
    results: list[bool] = []
    errors: list[BaseException] = []

    def finalize() -> None:
        start.wait()
        try:
            results.append(store.finish_if_done(batch_id))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=finalize) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert sorted(results) == [False] * 7 + [True]
    view = store.view(batch_id, "t")
    assert view["status"] == "completed"
    assert view["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    output = store.content(store.file(view["output_file_id"], "t")).read_bytes().splitlines()
    assert [orjson.loads(line)["custom_id"] for line in output] == [
        f"line-{i}" for i in range(LINES)
    ]
    assert not list((tmp_path / "files").glob("*.tmp"))
    journal.close()
