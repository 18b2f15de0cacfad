"""The alerting rules in deploy/prometheus: well formed, parsed by a PromQL parser, naming
only metrics and labels the server exports, each with a runbook that exists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from sluicegate.metrics.registry import Metrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RUNBOOK = ROOT / "docs" / "operations.md"
#: Labels Prometheus adds (scrape target) or that exist on every histogram bucket.
IMPLICIT_LABELS = {"instance", "job", "le"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def exported() -> dict[str, set[str]]:
    """Every series name the server exports, with its label names."""
    metrics = Metrics("torch")
    names: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            name, kind = value._name, value._type
            for suffix in _SUFFIXES[kind]:
                names[name + suffix] = set(value._labelnames)
    return names


def selectors(node: Any) -> list[tuple[str | None, set[str]]]:
    """(metric name, label names) of every vector selector in a parsed expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return [(node.name, {m.name for m in node.matchers.matchers})]
    if isinstance(node, promql_parser.MatrixSelector):
        return selectors(node.vector_selector)
    children: list[Any] = []
    if isinstance(node, promql_parser.BinaryExpr):
        children = [node.lhs, node.rhs]
    elif isinstance(node, promql_parser.Call):
        children = list(node.args)
    elif isinstance(node, promql_parser.AggregateExpr):
        children = [node.expr] + ([node.param] if node.param is not None else [])
    elif isinstance(
        node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)
    ):
        children = [node.expr]
    return [found for child in children for found in selectors(child)]


def unknown(expr: str, known: dict[str, set[str]]) -> list[str]:
    """What ``expr`` names that the server does not export."""
    problems = []
    for name, labels in selectors(promql_parser.parse(expr)):
        if name is None or name not in known:
            problems.append(f"metric {name}")
            continue
        for label in labels - known[name] - IMPLICIT_LABELS:
            problems.append(f"label {label} of {name}")
    return problems


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the document's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_rule_is_complete_and_unique() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) >= 9
    for rule in rules():
        assert {"alert", "expr", "for", "labels", "annotations"} <= set(rule), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["runbook"].startswith("docs/operations.md#")


def test_every_expression_parses_and_names_exported_metrics_only() -> None:
    known = exported()
    assert "sluicegate_time_to_first_token_seconds_bucket" in known
    assert "sluicegate_rejections_total" in known
    for rule in rules():
        assert unknown(rule["expr"], known) == [], rule["alert"]


def test_a_made_up_metric_or_label_is_caught() -> None:
    known = exported()
    assert unknown("rate(sluicegate_no_such_total[5m]) > 0", known) == [
        "metric sluicegate_no_such_total"
    ]
    assert unknown('sluicegate_kv_cache_usage_ratio{tenant="a"} > 0.9', known) == [
        "label tenant of sluicegate_kv_cache_usage_ratio"
    ]
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(x[5m]) >")


def test_every_runbook_exists() -> None:
    documented = anchors(RUNBOOK.read_text())
    for rule in rules():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor in documented, (rule["alert"], anchor)
