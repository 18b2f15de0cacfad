"""Each upstream's state as Prometheus metrics, read from the pool at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sluicegate.engine.upstream.pool import Upstream, UpstreamPool


class PoolCollector:
    """Each upstream's state as Prometheus metrics (label ``upstream``: the configured
    names, a handful), read at scrape time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        p = "sluicegate_upstream_"
        gauges: dict[str, tuple[str, Callable[[Upstream], float]]] = {
            "healthy": ("1 if it passes its health checks.", lambda u: 1.0 if u.healthy else 0.0),
            "limit": ("Requests it may hold at once (adaptive).", lambda u: u.limit),
            "outstanding_requests": ("Requests it holds.", lambda u: len(u.outstanding)),
            "outstanding_tokens": (
                "Prompt + max_tokens of the requests it holds.",
                lambda u: u.outstanding_tokens,
            ),
            "held_elsewhere": (
                "Requests other gateway replicas hold there (shared through Redis).",
                lambda u: u.held_elsewhere,
            ),
            "waiting_inside": (
                "Requests waiting inside it, from its own metrics.",
                lambda u: u.waiting_inside,
            ),
            "ttft_seconds": (
                "Its measured time to first token (moving average).",
                lambda u: u.latency.ttft_seconds or 0.0,
            ),
            "tpot_seconds": (
                "Its measured time per output token (moving average).",
                lambda u: u.latency.tpot_seconds or 0.0,
            ),
        }
        counters: dict[str, tuple[str, Callable[[Upstream], float]]] = {
            "requests": ("Requests sent to it.", lambda u: u.requests_total),
            "failures": ("Failed requests and health checks.", lambda u: u.failures_total),
            "aborts": ("Requests let go for a paused reader.", lambda u: u.aborts_total),
            "failovers": ("Answers moved away from it mid-stream.", lambda u: u.failovers_total),
            "pushbacks": ("Times it answered 429 or 503.", lambda u: u.pushbacks_total),
        }
        upstreams = list(self.pool.upstreams)
        for name, (doc, read) in gauges.items():
            gauge = GaugeMetricFamily(p + name, doc, labels=["upstream"])
            for upstream in upstreams:
                gauge.add_metric([upstream.name], float(read(upstream)))
            yield gauge
        for name, (doc, read) in counters.items():
            counter = CounterMetricFamily(p + name, doc, labels=["upstream"])
            for upstream in upstreams:
                counter.add_metric([upstream.name], float(read(upstream)))
            yield counter
        doc = "Answers cut for breaking the protocol (max_tokens, event_too_large)."
        errors = CounterMetricFamily(p + "protocol_errors", doc, labels=["upstream", "reason"])
        for upstream in upstreams:
            for reason, count in sorted(upstream.protocol_errors.items()):
                errors.add_metric([upstream.name, reason], float(count))
        yield errors
