"""Every Prometheus metric the server exports, in one place, prefixed ``sluicegate_``.

Labels are low-cardinality on purpose (tenant, priority class, reason, status, engine):
never a request id.  Each app builds its own :class:`Metrics` on its own registry, so
two apps in one process (tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

# Latency buckets from 1 ms to 2 min; token-count buckets by powers of two.
_LATENCY = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
_FAST = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_ERROR = (
    -10.0,
    -5.0,
    -2.0,
    -1.0,
    -0.5,
    -0.25,
    -0.1,
    -0.05,
    0.0,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
_PAUSE = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


#: Every metric's name starts with it.
PREFIX = "sluicegate_"


class Metrics:
    """The server's metrics.  Updated from the event loop and the engine thread."""

    def __init__(self, engine: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._latency_metrics(self.registry)
        self._outcome_metrics(self.registry)
        self._engine_step_metrics(self.registry)
        self._flow_metrics(self.registry)
        self._pipeline_metrics(self.registry)
        self._state_metrics(self.registry, engine)
        self._store_metrics(self.registry)

    def _latency_metrics(self, r: CollectorRegistry) -> None:
        """Where each request's time went, as its client saw it."""
        p = PREFIX
        self.time_to_first_token_seconds = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first token sent to the client.",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.time_per_output_token_seconds = Histogram(
            p + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_FAST,
            registry=r,
        )
        self.inter_token_latency_seconds = Histogram(
            p + "inter_token_latency_seconds",
            "Gap between consecutive writes to the client, per token (after chunking).",
            buckets=_FAST,
            registry=r,
        )
        self.e2e_request_latency_seconds = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to the last byte of the answer.",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.time_to_first_meaningful_token_seconds = Histogram(
            p + "time_to_first_meaningful_token_seconds",
            "Arrival to the first letter or digit sent to the client (TTFMT: not whitespace, "
            "a role or markup).",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.qoe = Histogram(
            p + "qoe",
            "Per interactive answer, the share of its tokens written no later than a reader "
            "at its pace needed them (after Andes; the TTFT objective, then 1/pace a token).",
            buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.ttft_prediction_error_seconds = Histogram(
            p + "ttft_prediction_error_seconds",
            "Measured minus predicted time to first token, per admitted request (admission "
            "by objective).",
            ["priority"],
            buckets=_ERROR,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            p + "queue_wait_seconds",
            "Arrival to first scheduled by the engine.",
            ["priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            p + "prefill_seconds",
            "First scheduled to first token (prompt processing).",
            buckets=_LATENCY,
            registry=r,
        )

    def _outcome_metrics(self, r: CollectorRegistry) -> None:
        """How requests ended, what they cost in tokens, and how fast a cancel took effect."""
        p = PREFIX
        self.requests_total = Counter(
            p + "requests", "Finished requests by outcome.", ["status"], registry=r
        )
        self.rejections_total = Counter(
            p + "rejections",
            "Requests refused before any engine work, by reason.",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens_total = Counter(
            p + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens_total = Counter(
            p + "generation_tokens", "Tokens generated.", registry=r
        )
        self.cancellations_total = Counter(
            p + "cancellations",
            "Sequences aborted because the client went away or cancelled.",
            registry=r,
        )
        self.cancel_latency_seconds = Histogram(
            p + "cancel_latency_seconds",
            "Disconnect or cancel to the sequence's abort.",
            buckets=_FAST,
            registry=r,
        )

    def _engine_step_metrics(self, r: CollectorRegistry) -> None:
        """What each engine step computed, and what it preempted."""
        p = PREFIX
        self.engine_step_seconds = Histogram(
            p + "engine_step_seconds", "Wall time of one engine step.", buckets=_FAST, registry=r
        )
        self.batch_size = Histogram(
            p + "batch_size", "Sequences in one engine step.", buckets=_COUNTS, registry=r
        )
        self.batch_tokens = Histogram(
            p + "batch_tokens", "Tokens computed in one engine step.", buckets=_COUNTS, registry=r
        )
        self.preemptions_total = Counter(
            p + "preemptions",
            "Sequences whose KV cache was freed, by reason.",
            ["reason"],
            registry=r,
        )

    def _flow_metrics(self, r: CollectorRegistry) -> None:
        """Flow control: pauses, evictions and backlogs."""
        p = PREFIX
        self.streams_paused = Gauge(
            p + "streams_paused",
            "Streams whose sequence is paused, by where the backlog is held: client (a slow "
            "reader) or a pipeline stage.",
            ["stage"],
            registry=r,
        )
        self.stream_pauses_total = Counter(
            p + "stream_pauses",
            "Pauses flow control asked for, by where the backlog was held.",
            ["stage"],
            registry=r,
        )
        self.stream_pause_seconds = Histogram(
            p + "stream_pause_seconds", "Duration of each pause.", buckets=_PAUSE, registry=r
        )
        self.streams_evicted_total = Counter(
            p + "streams_evicted",
            "Streams closed because the client stopped reading.",
            registry=r,
        )
        self.stream_buffer_tokens = Histogram(
            p + "stream_buffer_tokens",
            "Tokens produced but not yet received by the client (stage=client), or waiting "
            "in front of a pipeline stage, sampled at each flush.",
            ["stage"],
            buckets=_COUNTS,
            registry=r,
        )

    def _pipeline_metrics(self, r: CollectorRegistry) -> None:
        """Pipelines (docs/pipelines.md), and writes to client sockets."""
        p = PREFIX
        self.retrieval_seconds = Histogram(
            p + "retrieval_seconds",
            "Retrieval before generation, per request.",
            ["pipeline"],
            buckets=_FAST,
            registry=r,
        )
        self.guard_trips_total = Counter(
            p + "guard_trips",
            "Answers (input: prompts) stopped by a guard check.",
            ["pipeline", "check", "where"],
            registry=r,
        )
        self.guard_check_timeouts_total = Counter(
            p + "guard_check_timeouts",
            "Guard checks past their deadline (check_timeout_seconds): failed closed.",
            ["pipeline", "check", "where"],
            registry=r,
        )
        self.guard_check_seconds = Histogram(
            p + "guard_check_seconds",
            "One guard window's checks.",
            ["pipeline"],
            buckets=_FAST,
            registry=r,
        )
        self.stream_send_blocked_seconds = Histogram(
            p + "stream_send_blocked_seconds",
            "Time one write to the client socket blocked.",
            buckets=_FAST,
            registry=r,
        )

    def _state_metrics(self, r: CollectorRegistry, engine: str) -> None:
        """The engine core's state, copied in at each scrape."""
        p = PREFIX
        self.concurrency_limit = Gauge(
            p + "concurrency_limit",
            "Sequences that may decode at once: the TPOT objective's limit (the static "
            "max_num_seqs under --admission static).",
            registry=r,
        )
        self.requests_running = Gauge(
            p + "requests_running", "Sequences in the running batch.", registry=r
        )
        self.requests_waiting = Gauge(
            p + "requests_waiting", "Requests waiting for the engine.", ["priority"], registry=r
        )
        self.prefix_cache_tokens_total = Counter(
            p + "prefix_cache_tokens",
            "Prompt tokens looked up in the prefix cache (outcome=query) and found (hit).",
            ["outcome"],
            registry=r,
        )
        self.prefix_cache_evictions_total = Counter(
            p + "prefix_cache_evictions", "Cached KV slots emptied for new sequences.", registry=r
        )
        self.prefix_cache_cached_slots = Gauge(
            p + "prefix_cache_cached_slots",
            "KV slots with no sequence whose content is kept for reuse.",
            registry=r,
        )
        self.prefill_requests_total = Counter(
            p + "prefill_requests",
            "POST /v1/prefill warm-ups: accepted, superseded (by a newer one or the user's "
            "request) and completed.",
            ["outcome"],
            registry=r,
        )
        self.yielded_sequence_steps_total = Counter(
            p + "yielded_sequence_steps",
            "Steps a sequence sat out, far ahead of its reader, for a reader who was behind "
            "(scheduling: qoe).",
            registry=r,
        )
        self.scheduled_tokens_total = Counter(
            p + "scheduled_tokens",
            "Tokens the scheduler gave engine steps, by phase (prefill, decode) and class "
            "(docs/stall-free.md).",
            ["phase", "priority"],
            registry=r,
        )
        self.prefill_lane_tokens_total = Counter(
            p + "prefill_lane_tokens",
            "Prompt tokens prefilled, by lane (short, long: more than long_prompt_tokens left).",
            ["lane"],
            registry=r,
        )
        self.prefill_long_promoted_total = Counter(
            p + "prefill_long_promoted",
            "Long prompts sent ahead of short ones after being passed over too long.",
            registry=r,
        )
        self.prefill_budget_limited_steps_total = Counter(
            p + "prefill_budget_limited_steps",
            "Steps whose prompt tokens the decoders' TPOT objective cut short (stall-free "
            "prefill).",
            registry=r,
        )
        self.speculative_tokens_total = Counter(
            p + "speculative_tokens",
            "Prompt-lookup draft tokens proposed (outcome=proposed) and accepted (accepted).",
            ["outcome"],
            registry=r,
        )
        self.kv_cache_usage_ratio = Gauge(
            p + "kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", registry=r
        )
        self.kv_cache_bytes = Gauge(
            p + "kv_cache_bytes",
            "Bytes allocated for the KV cache when the engine loaded (0 for the sim engine).",
            registry=r,
        )
        self.engine_up = Gauge(
            p + "engine_up", "1 when the engine is loaded and stepping.", ["engine"], registry=r
        )
        self.engine_up.labels(engine).set(0)
        self.engine = engine

    def _store_metrics(self, r: CollectorRegistry) -> None:
        """Resumable streams and the shared store."""
        p = PREFIX
        self.store_available = Gauge(
            p + "store_available",
            "1 when the store (replay logs, leases, shared buckets) answered its last call.",
            registry=r,
        )
        self.store_available.set(1)
        self.store_degraded_operations_total = Counter(
            p + "store_degraded_operations",
            "Store operations run while the store was unreachable, by what they did instead "
            "(dropped, admitted, granted, raised).",
            ["operation", "outcome"],
            registry=r,
        )
        self.stream_resumes_total = Counter(
            p + "stream_resumes",
            "Resume requests (GET /v1/streams/{id}) by how they were served: attach (still "
            "generating here), replay (finished), follow (generating elsewhere), takeover "
            "(continued here), rejected.",
            ["status"],
            registry=r,
        )
        self.stream_leases_reclaimed_total = Counter(
            p + "stream_leases_reclaimed",
            "Generation leases that lapsed while nobody else took the stream (this replica "
            "stalled past their TTL: a busy machine) and were taken back, the stream going on.",
            registry=r,
        )
        self.streams_checkpointed_total = Counter(
            p + "streams_checkpointed",
            "Streams stopped with their state saved for any replica to continue, by reason "
            "(draining, detached, degraded_log).",
            ["reason"],
            registry=r,
        )
