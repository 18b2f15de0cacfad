"""deploy/grafana/sluicegate.json queries only metrics the server exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sluicegate.json"
METRIC_NAME = re.compile(r"\b((?:sluicegate|process)_[a-z0-9_]+)")
# Series a histogram or counter family exports beside its own name.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def exported_series(server: ServerProcess) -> set[str]:
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES)
    return names


def test_the_dashboard_is_well_formed() -> None:
    dashboard = orjson.loads(DASHBOARD.read_bytes())
    assert dashboard["uid"] == "sluicegate"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_every_queried_metric_is_exported(sim_server: ServerProcess) -> None:
    dashboard = orjson.loads(DASHBOARD.read_bytes())
    exported = exported_series(sim_server)
    queried = {
        name
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        for name in METRIC_NAME.findall(target["expr"])
    }
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queried.update(METRIC_NAME.findall(variable["definition"]))
    assert len(queried) > 20
    assert queried <= exported, sorted(queried - exported)
