"""Schema fuzzing of the published OpenAPI document with schemathesis.

Requests that follow the schema (positive) and requests that break it (negative) are
generated for every operation; each answer must be a 2xx or a 4xx in OpenAI's error
shape, never a 5xx, and the server must be healthy after.  The runs are derandomised (the
same cases every time) and bounded in count.
"""

from __future__ import annotations

from typing import Any

import hypothesis
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode

from tests.reliability.conftest import MODEL, assert_healthy
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

#: Cases per generation mode, over every operation.
MAX_EXAMPLES = 100


def check_answer(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500, f"{what} -> {status}: {body[:300]!r}"
    if status >= 400:
        assert content_type.startswith("application/json"), f"{what} -> {content_type}"
        error = orjson.loads(body)["error"]
        assert error["message"] and error["type"], f"{what} -> {body[:300]!r}"
        assert {"param", "code"} <= set(error), f"{what} -> {body[:300]!r}"


def steer(case: Any) -> None:
    """Name the served model in most bodies, so that cases get past the model check and
    exercise validation, admission and generation (a random name is only a 404)."""
    body = case.body
    if isinstance(body, dict) and "model" in body and hash(repr(sorted(body))) % 4:
        body["model"] = MODEL


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_fuzzed_request_is_answered_2xx_or_an_openai_4xx(
    open_server: ServerProcess, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(open_server.base_url + "/openapi.json")
    answered: list[int] = []

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=schema.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        if mode is GenerationMode.POSITIVE:
            steer(case)
        response = case.call(base_url=open_server.base_url, timeout=30)
        answered.append(response.status_code)
        what = f"{case.method} {case.formatted_path} {str(case.body)[:200]}"
        check_answer(
            response.status_code,
            response.headers.get("content-type", [""])[0],
            response.content,
            what,
        )

    fuzz()
    assert len(answered) >= MAX_EXAMPLES // 2
    if mode is GenerationMode.POSITIVE:
        assert any(200 <= status < 300 for status in answered), answered
    assert_healthy(open_server)
