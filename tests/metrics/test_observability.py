"""Metrics, /v1/stats, the request log and tracing, after a known workload, in process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import orjson
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from sluicegate.metrics.tracing import use_tracer
from tests.support.inprocess import InProcessApp, serve_in_process, streaming_client

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
    # Stall-free prefill: prefill or decode; the short or long lane.
    "phase",
    "lane",
}
TENANTS = [
    # A burst of 5, then one request every 100 s: nothing refills while a test runs.
    {"name": "t", "api_key": "k", "requests_per_second": 0.01, "request_burst": 5},
    {"name": "unlimited", "api_key": "k-unlimited"},
]


@contextlib.asynccontextmanager
async def metrics_app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(tenants=TENANTS) as app:
        yield app


async def scrape(app: InProcessApp) -> dict[str, float]:
    text = (await app.client.get("/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


async def known_workload(app: InProcessApp) -> tuple[list[int], list[float]]:
    """A burst of 8 streams against a burst of 5, then a request with no key: the
    statuses, and each admitted stream's time to its first text as its client saw it."""
    loop = asyncio.get_running_loop()

    async def one(client: httpx.AsyncClient) -> tuple[int, float | None]:
        body = {"model": MODEL, "prompt": "abcd", "max_tokens": 6, "ignore_eos": True}
        started = loop.time()
        ttft = None
        headers = {"authorization": "Bearer k"}
        async with client.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as resp:
            async for line in resp.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                    ttft = loop.time() - started
            return resp.status_code, ttft

    async with streaming_client(app) as client:
        results = await asyncio.gather(*(one(client) for _ in range(8)))
    no_key = await app.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert no_key.status_code == 401
    statuses = [status for status, _ in results]
    return statuses, [t for status, t in results if status == 200 and t is not None]


async def test_counters_match_a_known_workload() -> None:
    async with metrics_app() as app:
        statuses, client_ttft = await known_workload(app)
        admitted = statuses.count(200)
        rejected = statuses.count(429)
        assert admitted == 5 and rejected == 3
        m = await scrape(app)
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
    assert len(client_ttft) == admitted
    slowest_client = max(client_ttft)
    at_or_below = next(v for le, v in buckets if le >= slowest_client)
    assert at_or_below == admitted


async def test_metrics_parse_and_labels_are_low_cardinality() -> None:
    async with metrics_app() as app:
        await known_workload(app)
        text = (await app.client.get("/metrics")).text
        kv_cache_bytes = (await scrape(app))["sluicegate_kv_cache_bytes{}"]
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
    assert kv_cache_bytes == 0  # the sim keeps no KV


async def test_stats_snapshot() -> None:
    async with metrics_app() as app:
        await known_workload(app)
        stats = await app.stats()
    assert stats["ttft_seconds"]["p50"] is not None
    assert stats["ttft_seconds"]["p99"] >= stats["ttft_seconds"]["p50"]
    assert stats["tpot_seconds"]["p95"] is not None
    assert stats["ttfmt_seconds"]["p50"] is not None
    assert stats["breaker_state"] in ("closed", "shed_batch", "open")
    assert stats["rejections_by_reason"]["rate_limited_requests"] == 3
    assert "service_rate_requests_per_second" in stats["queue"]
    assert stats["kv_cache"]["bytes"] == 0


@contextlib.contextmanager
def request_log() -> Iterator[list[str]]:
    """The request log's lines (``sluicegate.requests``) while the block runs."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("sluicegate.requests")
    handler = Collect(logging.INFO)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


async def test_request_log_line_and_usage_timing() -> None:
    body = {
        "model": MODEL,
        "prompt": "log",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with request_log() as lines:
        async with metrics_app() as app:
            resp = await app.client.post(
                "/v1/completions", json=body, headers={"authorization": "Bearer k-unlimited"}
            )
    request_id = resp.headers["x-request-id"]
    chunks = [ln for ln in resp.text.splitlines() if ln.startswith("data: {")]
    final = orjson.loads(chunks[-1][6:])
    timing = final["usage"]["sluicegate"]
    assert timing["ttft_seconds"] > 0 and timing["queue_wait_seconds"] >= 0
    # The first letter comes with the first token or after it, if at all: the sim's
    # tokens are bytes, and three of them may hold no whole letter (None).
    ttfmt = timing["ttfmt_seconds"]
    assert ttfmt is None or ttfmt >= timing["ttft_seconds"]
    records = [orjson.loads(line) for line in lines if request_id in line]
    assert len(records) == 1, lines
    record = records[0]
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


async def test_otel_span_tree() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use_tracer(provider.get_tracer("test"))
    try:
        async with serve_in_process(sim_step_base_ms=2) as app:
            r = await app.client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "trace", "max_tokens": 4}
            )
            assert r.status_code == 200
    finally:
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
