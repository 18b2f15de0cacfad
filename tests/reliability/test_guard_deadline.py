"""Guard checks run off the event loop with a deadline (issue #31): a check that hangs,
in a thread or on the loop, fails closed (the answer ends with the guard's replacement
and ``content_filter``, counted in ``sluicegate_guard_check_timeouts_total``), and the
server answers everything else meanwhile."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.inprocess import InProcessApp, serve_in_process

MODEL = "sluicegate-sim"
#: Released at the end of each test: until then a blocking check holds its thread.
RELEASE = threading.Event()


class Blocking:
    """A plain check that blocks its thread (a hung library call)."""

    def check(self, text: str) -> str | None:
        RELEASE.wait(30)
        return None


class Hanging:
    """An async check that never answers (a moderation service that hangs)."""

    async def check(self, text: str) -> str | None:
        await asyncio.sleep(3600)
        return None


def guarded(name: str, check: str) -> dict[str, Any]:
    return {
        "name": name,
        "stages": [
            {
                "guard": {
                    "window_tokens": 8,
                    "stride_tokens": 4,
                    "replacement": "[withheld]",
                    "check_timeout_seconds": 0.2,
                    "checks": [{"type": f"tests.reliability.test_guard_deadline:{check}"}],
                }
            }
        ],
    }


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[InProcessApp]:
    config = {"pipelines": [guarded("blocking", "Blocking"), guarded("hanging", "Hanging")]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    RELEASE.clear()
    try:
        async with serve_in_process(config=tmp_path / "config.yaml", admission="static") as served:
            yield served
    finally:
        RELEASE.set()


@pytest.mark.parametrize("pipeline", ["blocking", "hanging"])
async def test_a_check_past_its_deadline_fails_closed(app: InProcessApp, pipeline: str) -> None:
    client = app.openai(max_retries=0)
    answer = asyncio.create_task(
        client.chat.completions.create(
            model=pipeline, messages=[{"role": "user", "content": "hi"}], max_tokens=40
        )
    )
    # While the check holds its thread (or hangs on the loop), the server answers.
    health = await app.client.get("/health")
    assert health.status_code == 200
    reply = await answer
    choice = reply.choices[0]
    assert choice.finish_reason == "content_filter"
    assert choice.message.content is not None and choice.message.content.endswith("[withheld]")
    metrics = await app.metrics()
    check = f"tests.reliability.test_guard_deadline:{pipeline.title()}"
    key = (
        "sluicegate_guard_check_timeouts_total"
        f'{{check="{check}",pipeline="{pipeline}",where="output"}}'
    )
    assert metrics.values.get(key) == 1, sorted(k for k in metrics.values if "guard" in k)
