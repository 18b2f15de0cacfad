"""Uploads are read a megabyte at a time, checked line by line as they come, and bounded
(issue #31, item 4): a line past the largest request body, a tenant's stored bytes past
its quota, a bad line anywhere (named by its number, across chunk boundaries).  Before,
the whole file was read into memory (six parallel 190 MB uploads took RSS to 1.4 GB) and
one tenant could store any amount."""

from __future__ import annotations

from pathlib import Path

import openai
import orjson
import pytest

from tests.support.inprocess import serve_in_process


def _lines(count: int, pad: int = 0) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"l{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "x" * pad, "max_tokens": 1},
            }
        )
        + b"\n"
        for i in range(count)
    )


async def test_a_large_file_streams_in_and_is_stored_exactly(tmp_path: Path) -> None:
    data = _lines(12_000, pad=200)  # ~3 MB: lines cross the 1 MB chunks
    async with serve_in_process(journal_path=str(tmp_path / "jobs.sqlite3")) as app:
        api = app.openai(max_retries=0)
        record = await api.files.create(file=("big.jsonl", data), purpose="batch")
        assert record.bytes == len(data) > 2 << 20
        assert (await api.files.content(record.id)).content == data
        # A bad line after the first megabyte is named by its number.
        bad = data + b'{"custom_id": "l0", "method": "POST"}\n'
        with pytest.raises(openai.BadRequestError) as refused:
            await api.files.create(file=("bad.jsonl", bad), purpose="batch")
        assert "line 12001 repeats the custom_id of line 1" in str(refused.value)
    assert not list((tmp_path / "files").glob("*.upload"))  # nothing left behind


async def test_a_line_past_the_largest_body_is_refused(tmp_path: Path) -> None:
    async with serve_in_process(
        journal_path=str(tmp_path / "jobs.sqlite3"), max_request_body_bytes=4096
    ) as app:
        api = app.openai(max_retries=0)
        data = _lines(3) + _lines(1, pad=10_000).replace(b'"l0"', b'"big"')
        with pytest.raises(openai.APIStatusError) as refused:
            await api.files.create(file=("in.jsonl", data), purpose="batch")
        assert refused.value.status_code == 413
        assert refused.value.code == "line_too_large" and "Line 4" in str(refused.value)


async def test_a_tenant_s_stored_bytes_are_bounded(tmp_path: Path) -> None:
    async with serve_in_process(
        journal_path=str(tmp_path / "jobs.sqlite3"), file_storage_bytes_per_tenant=6000
    ) as app:
        api = app.openai(max_retries=0)
        data = _lines(30)  # ~3 kB
        assert 2500 < len(data) < 3500
        first = await api.files.create(file=("a.jsonl", data), purpose="batch")
        with pytest.raises(openai.APIStatusError) as refused:
            await api.files.create(file=("b.jsonl", data + data), purpose="batch")
        assert refused.value.status_code == 413
        assert refused.value.code == "storage_quota_exceeded"
        await api.files.create(file=("c.jsonl", _lines(10)), purpose="batch")
        await api.files.delete(first.id)
        await api.files.create(file=("d.jsonl", data), purpose="batch")


async def test_a_line_whose_prompt_is_over_the_context_is_refused_at_upload(
    tmp_path: Path,
) -> None:
    """Each line's request is prepared as it would run: a prompt over the context is
    refused at upload naming its line, not hours later; a line's other errors are its
    answer in the error file when it runs (as OpenAI's)."""
    async with serve_in_process(
        journal_path=str(tmp_path / "jobs.sqlite3"), max_model_len=256
    ) as app:
        api = app.openai(max_retries=0)
        long_prompt = {"model": "sluicegate-sim", "prompt": "word " * 400, "max_tokens": 4}
        line = {"custom_id": "long", "method": "POST", "url": "/v1/completions"}
        data = _lines(3) + orjson.dumps({**line, "body": long_prompt}) + b"\n"
        with pytest.raises(openai.BadRequestError) as refused:
            await api.files.create(file=("in.jsonl", data), purpose="batch")
        message = str(refused.value)
        assert "line 4 (long)" in message and "maximum context length is 256" in message
        bad_temperature = {**long_prompt, "prompt": "hi", "temperature": 7}
        data = _lines(2) + orjson.dumps({**line, "body": bad_temperature}) + b"\n"
        assert (await api.files.create(file=("in.jsonl", data), purpose="batch")).bytes
