"""Schema fuzzing of the published OpenAPI document with schemathesis, in process.

Requests that follow the schema (positive) and requests that break it (negative) are
generated for every operation; each answer must be a 2xx or a 4xx in OpenAI's error
shape, never a 5xx (an exception in the app reaches the client too: ``ASGITransport``
raises it), and the app must be healthy after.  The runs are derandomised (the same
cases every time) and bounded in count.

The cases are bodies, parameters and routes, not sockets: the app is reached through
``httpx.ASGITransport`` (what uvicorn's parser does with malformed HTTP is
``test_hostile_inputs``'s, against a real server).  Each case is encoded exactly as
schemathesis's own ``requests`` transport would put it on the wire.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import httpx
import hypothesis
import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode

from tests.reliability.conftest import FAST_SIM, MODEL, assert_healthy_in_process
from tests.support.inprocess import BASE_URL, serve_in_process

#: Cases per generation mode, over every operation.
MAX_EXAMPLES = 100
#: Generous: an in-process answer takes milliseconds; only a hung app takes this long.
CALL_TIMEOUT_SECONDS = 60.0


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
    # crc32, not hash(): str hashes differ between runs, and the cases must not.
    if isinstance(body, dict) and "model" in body and zlib.crc32(repr(sorted(body)).encode()) % 4:
        body["model"] = MODEL


def wire_request(case: Any) -> requests.PreparedRequest:
    """The request as schemathesis's ``requests`` transport sends it (method, URL with
    its query, headers, encoded body)."""
    kwargs = case.as_transport_kwargs(base_url=BASE_URL)
    keep = ("method", "url", "headers", "params", "cookies", "data", "json", "files")
    return requests.Request(**{k: v for k, v in kwargs.items() if k in keep}).prepare()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
async def test_every_fuzzed_request_is_answered_2xx_or_an_openai_4xx(
    mode: GenerationMode,
) -> None:
    # Steps of 20 µs: generation is exercised, and a case asking for 256 tokens is quick.
    async with serve_in_process(*FAST_SIM, sim_step_base_ms=0.02, sim_step_per_token_ms=0) as app:
        published = (await app.client.get("/openapi.json")).json()
        schema = schemathesis.openapi.from_dict(published)
        loop = asyncio.get_running_loop()
        answered: list[int] = []

        def send(prepared: requests.PreparedRequest) -> httpx.Response:
            """From hypothesis's thread: the app runs in this test's event loop."""
            assert prepared.method is not None and prepared.url is not None
            call = app.client.request(
                prepared.method,
                prepared.url,
                headers=dict(prepared.headers),
                content=prepared.body,
                timeout=CALL_TIMEOUT_SECONDS,
            )
            return asyncio.run_coroutine_threadsafe(call, loop).result(CALL_TIMEOUT_SECONDS)

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
            response = send(wire_request(case))
            answered.append(response.status_code)
            what = f"{case.method} {case.formatted_path} {str(case.body)[:200]}"
            check_answer(
                response.status_code,
                response.headers.get("content-type", ""),
                response.content,
                what,
            )

        await asyncio.to_thread(fuzz)
        assert len(answered) >= MAX_EXAMPLES // 2
        if mode is GenerationMode.POSITIVE:
            assert any(200 <= status < 300 for status in answered), answered
        await assert_healthy_in_process(app)
