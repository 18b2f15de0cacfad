"""Helpers of the browser tests: Debian's Chromium driven by Playwright, and polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that reaches for the network: the machine has none.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MODEL = "sluicegate-sim"


def wait_until(
    predicate: Callable[[], bool], what: str, timeout: float = 15.0, interval: float = 0.05
) -> None:
    """Poll ``predicate`` from Python (the page's CSP forbids Playwright's eval-based waits)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting until {what}")
        time.sleep(interval)
