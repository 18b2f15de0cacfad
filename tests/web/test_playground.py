"""The playground in headless Chromium against the real server (sim engine, ~20 ms a token)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support import plain_http
from tests.support.servers import ARTIFACTS, ServerProcess, cancellations, start_servers
from tests.web.browser import MODEL, wait_until
from tests.web.load import StreamingLoad

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = pytest.mark.slow

SLOW_SIM = [
    "--engine",
    "sim",
    "--sim-step-base-ms",
    "20",
    "--sim-step-per-token-ms",
    "0.05",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "4096",
]
API_KEY = "sk-web-test"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """The two servers of the tests (:func:`web_server`, :func:`auth_server`), started
    together."""
    configs = tmp_path_factory.mktemp("web")
    # A pipeline whose guard trips on any visible character: its answers are the
    # replacement.  (Not on any Latin letter, as first written: the sim engine's text has
    # words without one, σήμα or 水門, and an answer that began with enough of them passed
    # them before the guard tripped: seen once in CI.)
    pipelines = configs / "pipelines.yaml"
    pipelines.write_text(
        "pipelines:\n  - name: guarded\n    stages:\n      - guard:\n"
        "          replacement: Filtered.\n          checks:\n"
        "            - {type: regex, patterns: ['\\S']}\n",
        encoding="utf-8",
    )
    # Auth on, and one request at a time for the one tenant: easy to get a real 429.
    tenants = configs / "tenants.yaml"
    tenants.write_text(
        f"tenants:\n  - name: web\n    api_key: {API_KEY}\n    max_concurrent: 1\n",
        encoding="utf-8",
    )
    started = start_servers(
        ([*SLOW_SIM, "--config", str(pipelines)], "web"),
        ([*SLOW_SIM, "--config", str(tenants)], "web-auth"),
    )
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def web_server(servers: list[ServerProcess]) -> ServerProcess:
    """With a pipeline, ``guarded``, whose guard trips on any visible character."""
    return servers[0]


@pytest.fixture(scope="module")
def auth_server(servers: list[ServerProcess]) -> ServerProcess:
    """Auth on (one tenant, ``API_KEY``), and one request at a time for it."""
    return servers[1]


def open_playground(page: Page, server: ServerProcess) -> None:
    page.goto(server.base_url + "/#playground")
    wait_until(lambda: page.locator("[data-testid=model] option").count() > 0, "models are listed")
    assert page.input_value("[data-testid=model]") == MODEL


def ask(page: Page, prompt: str, max_tokens: int) -> None:
    page.fill("[data-testid=max-tokens]", str(max_tokens))
    page.fill("[data-testid=prompt]", prompt)
    page.click("[data-testid=send]")


def state(page: Page) -> str:
    return page.get_attribute("[data-testid=playground]", "data-state") or ""


def text(page: Page, testid: str) -> str:
    return page.text_content(f"[data-testid={testid}]") or ""


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=path)
    return path


def test_the_answer_streams_in(page: Page, web_server: ServerProcess) -> None:
    open_playground(page, web_server)
    page.fill("[data-testid=system]", "You are a concise assistant.")
    ask(page, "What does a sluice gate do?", 150)  # ~3 s at ~20 ms a token

    wait_until(lambda: text(page, "output") != "", "the first text appears")
    first = text(page, "output")
    assert state(page) == "streaming"
    assert page.is_enabled("[data-testid=stop]") and page.is_disabled("[data-testid=send]")
    # More text arrives while the answer is still being generated.
    wait_until(lambda: len(text(page, "output")) > len(first) + 20, "more text streams in")
    assert state(page) == "streaming"

    wait_until(lambda: state(page) == "done", "the answer completes", timeout=30)
    final = text(page, "output")
    assert final.startswith(first) and len(final) > len(first) + 20
    assert text(page, "tokens") == "150"
    assert text(page, "finish") == "finish: length"
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", text(page, "ttft")), text(page, "ttft")
    tokens_per_second = float(text(page, "tps"))
    assert 5 < tokens_per_second < 500  # one token per ~20 ms engine step
    assert page.is_hidden("[data-testid=error]")
    assert page.is_disabled("[data-testid=stop]") and page.is_enabled("[data-testid=send]")
    screenshot(page, "playground.png")


def test_stop_cancels_the_generation(page: Page, web_server: ServerProcess) -> None:
    open_playground(page, web_server)
    cancelled_before = cancellations(web_server)
    ask(page, "Please write a very long answer.", 3000)  # a minute if left alone

    wait_until(lambda: len(text(page, "output")) > 30, "the answer is under way")
    with page.expect_response(lambda r: r.url.endswith("/cancel")) as info:
        page.click("[data-testid=stop]")
        stopped_at_monotonic = time.monotonic()
    cancel = info.value
    assert cancel.status == 200 and cancel.request.method == "POST"
    assert cancel.request.all_headers()["x-sluicegate-resume-token"]
    wait_until(lambda: state(page) == "stopped", "the page shows the answer stopped")
    assert text(page, "status") == "stopped"
    assert page.is_disabled("[data-testid=stop]") and page.is_enabled("[data-testid=send]")
    assert page.is_hidden("[data-testid=error]")

    # Stop cancelled the generation on the server at once, not after the detached grace
    # of a resumable stream whose connection closed (1 s).
    wait_until(
        lambda: plain_http.stats(web_server)["requests_running"] == 0, "no sequence is left running"
    )
    assert time.monotonic() - stopped_at_monotonic < 0.8
    assert cancellations(web_server) - cancelled_before == 1
    stopped_at = text(page, "output")
    time.sleep(0.5)
    assert text(page, "output") == stopped_at
    assert int(text(page, "tokens")) < 3000


def test_a_bad_request_shows_the_server_reason(page: Page, web_server: ServerProcess) -> None:
    open_playground(page, web_server)
    ask(page, "hello", 0)
    wait_until(lambda: state(page) == "error", "the request fails")
    error = text(page, "error")
    assert error.startswith("400 Bad Request: "), error
    assert "max_tokens" in error
    assert text(page, "output") == ""


def test_a_pipeline_is_picked_and_its_tripped_guard_shown(
    page: Page, web_server: ServerProcess
) -> None:
    open_playground(page, web_server)
    assert page.locator("optgroup[label=Pipelines] option").all_text_contents() == ["guarded"]
    page.select_option("[data-testid=model]", "guarded")
    assert text(page, "pipeline-info") == "Pipeline: generate → guard"
    ask(page, "Tell me a story.", 100)
    wait_until(lambda: state(page) == "done", "the answer ends")
    assert text(page, "output") == "Filtered."
    assert text(page, "finish") == "finish: content_filter"
    assert page.is_visible("[data-testid=guard]")
    assert "guard stopped this answer" in text(page, "guard")
    page.select_option("[data-testid=model]", MODEL)
    assert page.is_hidden("[data-testid=pipeline-info]")
    ask(page, "Tell me a story.", 20)
    wait_until(lambda: state(page) == "done", "the next answer ends")
    assert page.is_hidden("[data-testid=guard]")


def test_json_mode_asks_for_a_json_answer(page: Page, web_server: ServerProcess) -> None:
    """The sim engine cannot constrain its output: the request's response_format is
    refused by name, which shows the page sent it (the embedded engine's JSON answers
    are tested in tests/engine/torch/test_server.py)."""
    open_playground(page, web_server)
    page.check("[data-testid=json-mode]")
    assert page.is_visible("[data-testid=schema]")
    page.fill("[data-testid=schema]", "{not json")
    ask(page, "A person, as JSON.", 50)
    wait_until(lambda: state(page) == "error", "the bad schema is refused in the page")
    assert "not valid JSON" in text(page, "error")
    page.fill("[data-testid=schema]", '{"type": "object"}')
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("[data-testid=send]")
    body = sent.value.post_data_json
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "playground", "schema": {"type": "object"}},
    }
    wait_until(lambda: state(page) == "error", "the sim refuses it")
    assert "response_format" in text(page, "error")


def test_api_key_and_rate_limit(page: Page, auth_server: ServerProcess) -> None:
    page.goto(auth_server.base_url + "/#playground")  # with tenants, even /v1/models needs a key
    wait_until(lambda: text(page, "error") != "", "the keyless model list is refused")
    assert text(page, "error").startswith("Could not list the models: 401 Unauthorized: ")
    assert "Set the API key" in text(page, "error")

    # The key unlocks the API, and is kept in the browser across reloads.
    page.fill("[data-testid=api-key]", API_KEY)
    page.press("[data-testid=api-key]", "Enter")
    open_playground(page, auth_server)
    assert page.is_hidden("[data-testid=error]")
    page.reload()
    open_playground(page, auth_server)
    assert page.input_value("[data-testid=api-key]") == API_KEY

    # The tenant's one concurrent request is taken by another client: a real 429.
    with StreamingLoad(
        auth_server.base_url, MODEL, num_clients=1, max_tokens=3000, api_key=API_KEY
    ) as holder:
        wait_until(
            lambda: plain_http.stats(auth_server)["requests_running"] == 1, "the slot is taken"
        )
        with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as info:
            ask(page, "hello", 16)
        response = info.value
        assert response.request.all_headers()["authorization"] == f"Bearer {API_KEY}"
        assert response.status == 429
        retry_after = response.headers["retry-after"]
        wait_until(lambda: state(page) == "error", "the 429 is shown")
        error = text(page, "error")
        assert error.startswith("429 Too Many Requests: "), error
        assert error.endswith(f"Retry after {retry_after} s."), error
        screenshot(page, "playground-429.png")
    assert holder.errors == []

    wait_until(
        lambda: plain_http.stats(auth_server)["requests_running"] == 0, "the slot is free again"
    )
    ask(page, "hello", 16)
    wait_until(lambda: state(page) in ("done", "error"), "the answer completes")
    assert state(page) == "done", text(page, "error")
    assert text(page, "tokens") == "16"


def test_typing_warms_the_prefix_cache(page: Page, web_server: ServerProcess) -> None:
    """While the user types, the playground sends what is typed so far to /v1/prefill
    (debounced); the question sent in the end reuses that warmed prefix."""
    open_playground(page, web_server)
    page.fill("[data-testid=system]", "You are the assistant of a bakery. " * 30)
    hits = plain_http.stats(web_server)["prefix_cache"]["hits"]
    page.type("[data-testid=prompt]", "When do you open", delay=20)
    wait_until(
        lambda: page.get_attribute("[data-testid=playground]", "data-warmed"),
        "a warm-up was accepted",
    )
    ask(page, "When do you open on Sunday?", 5)
    wait_until(lambda: state(page) == "done", "the answer completes", timeout=30)
    assert plain_http.stats(web_server)["prefix_cache"]["hits"] > hits
