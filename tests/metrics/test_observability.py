"""Metrics, /v1/stats, the request log and tracing, after a known workload."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from sluicegate.api.app import create_app
from sluicegate.config import load_settings
from sluicegate.metrics.tracing import use_tracer
from tests.support.servers import ServerProcess, free_port, start_server

pytestmark = pytest.mark.slow

MODEL = "sluicegate-sim"
ALLOWED_LABELS = {
    "status",
    "reason",
    "priority",
    "engine",
    "tenant",
    "operation",
    "outcome",
    "le",
    "quantile",
    # Pipelines: names from the config file (stages, pipelines, checks), input or output.
    "stage",
    "pipeline",
    "check",
    "where",
}


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("metrics") / "cfg.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "engine": "sim",
                "sim_step_base_ms": 20,
                # A burst of 5, then one request every 100 s: no refill while the
                # tests run, however slow the machine.
                "tenants": [
                    {"name": "t", "api_key": "k", "requests_per_second": 0.01, "request_burst": 5},
                    {"name": "unlimited", "api_key": "k-unlimited"},
                ],
            }
        )
    )
    server = start_server(["--config", str(path)], "metrics")
    yield server
    server.stop()


def scrape(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_counters_match_a_known_workload(metrics_server: ServerProcess) -> None:
    headers = {"authorization": "Bearer k"}
    url = metrics_server.v1 + "/completions"

    def one(_: int) -> tuple[int, float | None]:
        body = {
            "model": MODEL,
            "prompt": "abcd",
            "max_tokens": 6,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.monotonic()
        ttft = None
        with httpx.stream("POST", url, json=body, headers=headers, timeout=10) as resp:
            for line in resp.iter_lines():
                if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                    ttft = time.monotonic() - started
            return resp.status_code, ttft

    # A burst of 8 at once against a burst of 5: 5 admitted, 3 rate limited.
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    statuses = [status for status, _ in results]
    client_ttft = [t for status, t in results if status == 200 and t is not None]
    admitted = statuses.count(200)
    rejected = statuses.count(429)
    assert admitted == 5 and rejected == 3
    httpx.post(url, json={"model": MODEL, "prompt": "x"}, timeout=5)  # 401: no key
    m = scrape(metrics_server)
    assert m["sluicegate_requests_total{status=length}"] == admitted
    assert m["sluicegate_generation_tokens_total{}"] == admitted * 6
    assert m["sluicegate_prompt_tokens_total{}"] == admitted * 4
    assert m["sluicegate_rejections_total{reason=rate_limited_requests}"] == rejected
    assert m["sluicegate_rejections_total{reason=auth}"] == 1
    for name in (
        "time_to_first_token_seconds",
        "time_to_first_meaningful_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_wait_seconds",
        "prefill_seconds",
        "engine_step_seconds",
        "batch_size",
        "batch_tokens",
    ):
        counts = [v for k, v in m.items() if k.startswith(f"sluicegate_{name}_count")]
        assert counts and sum(counts) > 0, name
    # The client's TTFT falls in (or below) the server's bucket for it: the server's
    # histogram cannot have every observation above what the client saw.
    buckets = sorted(
        (float(k.split("le=")[1].split(",")[0].rstrip("}")), v)
        for k, v in m.items()
        if k.startswith("sluicegate_time_to_first_token_seconds_bucket")
        and "priority=interactive" in k  # the batch class's series exists too, empty
    )
    slowest_client = max(client_ttft)
    at_or_below = next(v for le, v in buckets if le >= slowest_client)
    assert at_or_below == admitted


def test_metrics_parse_and_labels_are_low_cardinality(metrics_server: ServerProcess) -> None:
    text = httpx.get(metrics_server.base_url + "/metrics", timeout=5).text
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        if not family.name.startswith("sluicegate_"):
            continue  # process and platform collectors
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (family.name, sample.labels)
            assert not any(v.startswith(("cmpl-", "chatcmpl-")) for v in sample.labels.values())
    for required in (
        "sluicegate_requests_running",
        "sluicegate_requests_waiting",
        "sluicegate_streams_paused",
        "sluicegate_kv_cache_usage_ratio",
        "sluicegate_engine_up",
        "sluicegate_preemptions",
        "sluicegate_streams_evicted",
        "sluicegate_cancellations",
        "sluicegate_cancel_latency_seconds",
        "sluicegate_kv_cache_bytes",
        "process_resident_memory_bytes",
    ):
        assert required in names, required
    assert scrape(metrics_server)["sluicegate_kv_cache_bytes{}"] == 0  # the sim keeps no KV


def test_stats_snapshot(metrics_server: ServerProcess) -> None:
    stats = httpx.get(metrics_server.base_url + "/v1/stats", timeout=5).json()
    assert stats["ttft_seconds"]["p50"] is not None
    assert stats["ttft_seconds"]["p99"] >= stats["ttft_seconds"]["p50"]
    assert stats["tpot_seconds"]["p95"] is not None
    assert stats["ttfmt_seconds"]["p50"] is not None
    assert stats["breaker_state"] in ("closed", "shed_batch", "open")
    assert stats["rejections_by_reason"]["rate_limited_requests"] >= 3
    assert "service_rate_requests_per_second" in stats["queue"]
    assert stats["kv_cache"]["bytes"] == 0


def test_request_log_line_and_usage_timing(metrics_server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "log",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        metrics_server.v1 + "/completions",
        json=body,
        headers={"authorization": "Bearer k-unlimited"},
        timeout=10,
    ) as resp:
        request_id = resp.headers["x-request-id"]
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
    final = orjson.loads(lines[-1][6:])
    timing = final["usage"]["sluicegate"]
    assert timing["ttft_seconds"] > 0 and timing["queue_wait_seconds"] >= 0
    # The first letter comes with the first token or after it, if at all: the sim's
    # tokens are bytes, and three of them may hold no whole letter (None).
    ttfmt = timing["ttfmt_seconds"]
    assert ttfmt is None or ttfmt >= timing["ttft_seconds"]
    deadline = time.monotonic() + 2
    record = None
    while record is None and time.monotonic() < deadline:
        for line in metrics_server.log().splitlines():
            if request_id in line and line.startswith("{"):
                record = orjson.loads(line)
        time.sleep(0.05)
    assert record is not None
    for key in (
        "tenant",
        "prompt_tokens",
        "output_tokens",
        "queue_wait_seconds",
        "ttft_seconds",
        "tpot_seconds",
        "finish_reason",
        "paused_seconds",
        "preemptions",
    ):
        assert key in record, key
    assert record["tenant"] == "unlimited" and record["output_tokens"] == 3


def test_otel_span_tree(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use_tracer(provider.get_tracer("test"))
    port = free_port()
    settings = load_settings(
        None, engine="sim", port=port, sim_step_base_ms=2, cache_dir=str(tmp_path)
    )
    server = uvicorn.Server(uvicorn.Config(create_app(settings), port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": MODEL, "prompt": "trace", "max_tokens": 4},
            timeout=10,
        )
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
        use_tracer(None)
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "sluicegate.request")
    children = {
        s.name: s
        for s in spans
        if s.parent is not None and s.parent.span_id == root.context.span_id
    }
    assert set(children) == {"queue", "prefill", "decode"}
    assert root.attributes is not None and root.attributes["gen_ai.usage.output_tokens"] == 4
    assert children["queue"].end_time <= children["prefill"].end_time <= children["decode"].end_time
