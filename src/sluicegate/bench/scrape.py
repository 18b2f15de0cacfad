"""Read the server's ``/metrics``: gauges over time, and counters before and after a run.

Any Prometheus endpoint works; series the server does not export stay ``None`` (another
OpenAI-compatible server still reports ``process_resident_memory_bytes``, say).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sluicegate.bench.records import SeriesPoint

#: Gauges sampled over time; a labelled gauge is summed over its labels.
SERIES_METRICS = {
    "process_resident_memory_bytes": "resident_memory_bytes",
    "sluicegate_kv_cache_usage_ratio": "kv_cache_usage_ratio",
    "sluicegate_requests_waiting": "requests_waiting",
    "sluicegate_requests_running": "requests_running",
    "sluicegate_streams_paused": "streams_paused",
    "sluicegate_concurrency_limit": "concurrency_limit",
}

#: Counters compared before and after a run (sample names, with their labels).
COUNTER_METRICS = (
    "sluicegate_requests_total",
    "sluicegate_rejections_total",
    "sluicegate_prompt_tokens_total",
    "sluicegate_generation_tokens_total",
    "sluicegate_cancellations_total",
    "sluicegate_streams_evicted_total",
    "sluicegate_preemptions_total",
    "sluicegate_yielded_sequence_steps_total",
)


@dataclass(slots=True)
class MetricsSnapshot:
    """Every sample of one scrape, keyed ``name{label="value",...}`` (labels sorted)."""

    values: dict[str, float] = field(default_factory=dict)

    def total(self, name: str) -> float:
        """The sum of ``name`` over all its label sets (0 if absent)."""
        prefix = name + "{"
        return sum(v for k, v in self.values.items() if k == name or k.startswith(prefix))

    def get(self, name: str) -> float | None:
        """The sum of ``name`` over its label sets, or None when the server lacks it."""
        prefix = name + "{"
        found = [v for k, v in self.values.items() if k == name or k.startswith(prefix)]
        return sum(found) if found else None

    def counters(self) -> dict[str, float]:
        prefixes = tuple(COUNTER_METRICS)
        return {k: v for k, v in self.values.items() if k.startswith(prefixes)}


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse the Prometheus text format into a flat snapshot."""
    snapshot = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            snapshot.values[key] = float(sample.value)
    return snapshot


def admin_headers() -> dict[str, str]:
    """The admin key of a server whose ``/metrics`` and ``/v1/stats`` are protected
    (``admin_api_key``), taken from ``SLUICEGATE_ADMIN_API_KEY`` when it is set."""
    key = os.environ.get("SLUICEGATE_ADMIN_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def scrape_once(client: httpx.Client, base_url: str) -> MetricsSnapshot | None:
    """One scrape; None when the server has no usable ``/metrics``."""
    try:
        response = client.get(base_url + "/metrics", headers=admin_headers(), timeout=2.0)
        if response.status_code != 200:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


#: Gauges of the requests a Sluicegate server holds, all 0 when it holds none.
HELD_WORK_METRICS = (
    "sluicegate_requests_running",
    "sluicegate_requests_waiting",
    "sluicegate_streams_paused",
)
#: Gauges of live work, all 0 on an idle server.
LIVE_WORK_METRICS = (*HELD_WORK_METRICS, "sluicegate_kv_cache_usage_ratio")


def scrape_live_work(base_url: str) -> dict[str, float]:
    """The live-work gauges now (empty when the server has no usable ``/metrics``)."""
    with httpx.Client() as client:
        snapshot = scrape_once(client, base_url)
    if snapshot is None:
        return {}
    return {name: snapshot.total(name) for name in LIVE_WORK_METRICS}


#: Gauges by which engines report the requests they hold (0 when idle): llama.cpp's
#: llama-server (``--metrics``) and vLLM.
ENGINE_WORK_METRICS = (
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


def wait_until_idle(base_url: str, timeout_seconds: float = 60.0) -> bool:
    """Until the server at ``base_url`` holds no work by its ``/metrics`` (Sluicegate's
    live-work gauges, an engine's running and waiting requests), or ``timeout_seconds``
    pass; whether it went idle.  A plain engine keeps working through what a run's cut
    clients left it, and the next run would start behind it.  A server without usable
    ``/metrics`` counts as idle."""
    names = (*HELD_WORK_METRICS, *ENGINE_WORK_METRICS)
    deadline = time.monotonic() + timeout_seconds
    with httpx.Client() as client:
        while True:
            snapshot = scrape_once(client, base_url)
            if snapshot is None or all(snapshot.total(name) == 0 for name in names):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` for every counter seen in either."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted({*before, *after})}


class MetricsScraper:
    """Scrapes ``/metrics`` every ``interval_seconds`` on its own thread."""

    def __init__(self, base_url: str, run_start: float, interval_seconds: float = 0.5) -> None:
        self.base_url = base_url
        self.run_start = run_start
        self.interval_seconds = interval_seconds
        self.series: list[SeriesPoint] = []
        self.latest: SeriesPoint | None = None
        self.available = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)
        self._client = httpx.Client()

    def snapshot(self) -> MetricsSnapshot | None:
        return scrape_once(self._client, self.base_url)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with contextlib.suppress(Exception):
            self._client.close()

    def _run(self) -> None:
        failures = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            snapshot = scrape_once(self._client, self.base_url)
            if snapshot is None:
                failures += 1
                self.available = failures < 3 or bool(self.series)
            else:
                point = SeriesPoint(time.monotonic() - self.run_start)
                for metric, attribute in SERIES_METRICS.items():
                    setattr(point, attribute, snapshot.get(metric))
                self.series.append(point)
                self.latest = point
            next_at += self.interval_seconds
            self._stop.wait(max(0.0, next_at - time.monotonic()))
