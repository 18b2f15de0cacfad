"""Fixtures of the web tests: a headless Chromium and a fresh page per test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.conftest import skip_unless_installed
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    skip_unless_installed(CHROMIUM.is_file(), f"Chromium ({CHROMIUM})", "apt-get install chromium")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="browser tests need playwright (pip install -e '.[test]')"
    )
    with sync_api.sync_playwright() as playwright:
        # Never `playwright install`: it downloads a browser, and this machine has no network.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh context (own localStorage); fails the test on a script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))

    def on_console(message: ConsoleMessage) -> None:
        # Failed fetches (401, 429) are logged too and are expected; CSP refusals are not.
        if message.type == "error" and "Content Security Policy" in message.text:
            problems.append(f"console: {message.text}")

    page.on("console", on_console)
    yield page
    context.close()
    assert not problems, problems
