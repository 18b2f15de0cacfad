"""Small inputs that were accepted and should not be (issue #31, item 6): a message
without content, batch metadata past OpenAI's bounds, cancelling a finished batch."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.support.inprocess import serve_in_process, wait_until


@pytest.mark.parametrize("role", ["user", "system", "tool"])
async def test_a_message_without_content_is_a_400(role: str) -> None:
    async with serve_in_process() as app:
        messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
        if role == "tool":
            messages[1]["tool_call_id"] = "call_1"
        response = await app.client.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages[1].content"
        # An assistant turn of tool calls has none, rightly.
        ok = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "done"},
        ]
        answer = await app.client.post(
            "/v1/chat/completions", json={"messages": ok, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text


async def test_batch_metadata_is_bounded_and_a_finished_batch_is_not_cancelled(
    tmp_path: Path,
) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions"}
    data = orjson.dumps({**line, "body": {"prompt": "x", "max_tokens": 2}}) + b"\n"
    async with serve_in_process(journal_path=str(tmp_path / "jobs.sqlite3")) as app:
        api = app.openai(max_retries=0)
        source = await api.files.create(file=("in.jsonl", data), purpose="batch")
        create = {"input_file_id": source.id, "endpoint": "/v1/completions"}
        for metadata in (
            {f"k{i}": "v" for i in range(17)},
            {"k" * 65: "v"},
            {"k": "v" * 513},
        ):
            response = await app.client.post(
                "/v1/batches", json={**create, "completion_window": "24h", "metadata": metadata}
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "metadata"
        batch = await api.batches.create(
            **create, completion_window="24h", metadata={"k" * 64: "v" * 512}
        )

        async def completed() -> bool:
            return (await api.batches.retrieve(batch.id)).status == "completed"

        await wait_until(completed, "the batch completes", 60)
        refused = await app.client.post(f"/v1/batches/{batch.id}/cancel")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "batch_not_cancellable"
        assert (await api.batches.retrieve(batch.id)).status == "completed"


@pytest.mark.parametrize("engine", ["sim", "upstream"])
def test_a_model_path_for_an_engine_that_loads_none_is_refused(engine: str) -> None:
    """``--engine sim --model /nonexistent`` started, serving the sim under a path that
    does not exist; the model is the torch engine's."""
    from pydantic import ValidationError

    from sluicegate.config import Settings

    extra = {"upstreams": [{"url": "http://127.0.0.1:9"}]} if engine == "upstream" else {}
    with pytest.raises(ValidationError, match="is for the torch engine"):
        Settings(engine=engine, model="/nonexistent.gguf", **extra)
