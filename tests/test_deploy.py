"""The Kubernetes manifests in deploy/k8s: valid against the Kubernetes schemas (the
``kubernetes-validate`` package ships them), and consistent with Sluicegate's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sluicegate.config import Settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
#: preStop's sleep action needs 1.30 or later.
KUBERNETES_VERSION = "1.31.0"


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize(("where", "doc"), documents(), ids=[w for w, _ in documents()])
def test_every_manifest_is_valid(where: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def gateway_settings() -> Settings:
    config = yaml.safe_load(by_kind("ConfigMap", "sluicegate")["data"]["sluicegate.yaml"])
    return Settings(**config)


def test_the_gateway_config_is_valid_and_lists_every_engine() -> None:
    settings = gateway_settings()
    assert settings.engine == "upstream" and settings.store.startswith("redis://")
    engines = by_kind("StatefulSet", "vllm")
    service = engines["spec"]["serviceName"]
    names = {f"http://vllm-{i}.{service}:8000" for i in range(engines["spec"]["replicas"])}
    assert {u.url for u in settings.upstream_configs} == names
    redis = by_kind("Service", "redis")
    assert (
        settings.store
        == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
    )


def test_shutdown_leaves_time_to_drain() -> None:
    pod = by_kind("Deployment", "sluicegate")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = gateway_settings().drain_grace_seconds
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    hpa = by_kind("HorizontalPodAutoscaler", "sluicegate")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"].startswith("sluicegate_")
