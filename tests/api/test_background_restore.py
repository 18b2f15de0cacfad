"""A background response that a restart interrupted is known again before the server
serves (the in-memory store lost it; the journal did not): a client polling right after
the restart finds it queued, not unknown, until the job runner reaches it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from sluicegate.api.responses_background import restore_background
from sluicegate.queue.journal import JobJournal
from tests.support.inprocess import gate_engine, serve_in_process

TENANTS = [{"name": "alpha", "api_key": "key-alpha"}]


async def test_an_interrupted_background_response_is_restored_before_serving(
    tmp_path: Path,
) -> None:
    # The job as the first server journaled it (its engine held: it never ran).
    async with serve_in_process(admission="static", tenants=TENANTS) as first:
        with gate_engine(first):
            alpha = first.openai(api_key="key-alpha", max_retries=0)
            started = await alpha.responses.create(input="Hi", background=True, max_output_tokens=8)
            assert first.state.ready is not None
            record = first.state.ready.jobs.journal.get(started.id)
            assert record is not None
    journal = JobJournal(tmp_path / "jobs.sqlite3")
    journal.submit(record.job_id, record.tenant, record.body_json)
    # A new server: its in-memory store knows nothing of it yet.
    async with serve_in_process(admission="static", tenants=TENANTS) as second:
        alpha = second.openai(api_key="key-alpha", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await alpha.responses.retrieve(started.id)
        assert second.state.ready is not None
        assert await restore_background(second.state.ready.sessions, journal) == 1
        restored = await alpha.responses.retrieve(started.id)
        assert restored.status == "queued" and restored.id == started.id
        # Once is enough: what the store holds is not written again.
        assert await restore_background(second.state.ready.sessions, journal) == 0
    journal.close()
