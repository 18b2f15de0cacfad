"""docs/clients.md names the versions the client tests ran with: the ones the ``test``
extra pins and the ones installed (a client's new release changes what it sends, so a
version the docs claim must be the one tested)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CLIENTS = ("langchain-openai", "instructor", "pydantic-ai-slim", "litellm")


def documented() -> dict[str, str]:
    """``{package: version}`` from the table of docs/clients.md."""
    text = (ROOT / "docs" / "clients.md").read_text()
    rows = re.findall(r"^\|[^|]*\| `([\w.-]+)(?:\[\w+\])?` ([\d.]+) \|", text, re.MULTILINE)
    return dict(rows)


def pinned() -> dict[str, str]:
    """``{package: version}`` of the ``==`` pins in the ``test`` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for spec in project["optional-dependencies"]["test"]:
        match = re.fullmatch(r"([\w.-]+)(?:\[[\w,]+\])?==([\d.]+)", spec)
        if match:
            pins[match.group(1)] = match.group(2)
    return pins


def test_the_documented_clients_are_the_pinned_and_installed_ones() -> None:
    docs, pins = documented(), pinned()
    for client in CLIENTS:
        assert docs.get(client) == pins.get(client), client
        assert metadata.version(client) == pins[client], client
    # openai itself is not pinned (>=1.40): the docs name the version installed.
    assert docs["openai"] == metadata.version("openai")
