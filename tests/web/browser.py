"""Helpers of the browser tests: Debian's Chromium driven by Playwright, and polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


def metric_total(base_url: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in the server's /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )
