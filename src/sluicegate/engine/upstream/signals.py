"""What an upstream tells about itself: its answers' latency (measured by the gateway),
its load (read from its own Prometheus metrics) and its models' contexts (its
/v1/models)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: Gauges by which engines report requests waiting inside them (summed when present).
WAITING_GAUGES = (
    "vllm:num_requests_waiting",  # vLLM
    "sglang:num_queue_reqs",  # SGLang
    "tgi_queue_size",  # TGI
    "llamacpp:requests_deferred",  # llama.cpp's llama-server (--metrics)
    "sluicegate_requests_waiting",  # another Sluicegate
)
#: Gauges of how many requests it runs at once, when it says (another Sluicegate).
SEAT_GAUGES = ("sluicegate_concurrency_limit",)
#: Gauges of its KV cache use, as a ratio (vLLM, SGLang) when present.
KV_GAUGES = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "sglang:token_usage")


@dataclass(slots=True)
class Latency:
    """Exponentially weighted TTFT and TPOT of one upstream's answers."""

    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    #: Seconds of TTFT per prompt token beyond the first (a least-squares slope, kept as
    #: running sums of recent answers).
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, prompt_tokens: int, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self.ttft_seconds = _ewma(self.ttft_seconds, ttft, 0.2)
            decay = 0.98
            self._n = self._n * decay + 1.0
            self._sx = self._sx * decay + prompt_tokens
            self._sy = self._sy * decay + ttft
            self._sxx = self._sxx * decay + prompt_tokens * prompt_tokens
            self._sxy = self._sxy * decay + prompt_tokens * ttft
        if tpot is not None:
            self.tpot_seconds = _ewma(self.tpot_seconds, tpot, 0.2)

    def fit(self) -> tuple[float, float] | None:
        """(seconds, seconds per prompt token) of its TTFT, fitted on recent answers (a
        flat line at the mean when their prompts were all alike); None before any."""
        if self._n < 1.0 or self.ttft_seconds is None:
            return None
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mean_x * mean_x
        if var < 1.0:
            return self.ttft_seconds, 0.0
        slope = max(0.0, (self._sxy / self._n - mean_x * mean_y) / var)
        return max(0.0, mean_y - slope * mean_x), slope


class PrefillLedger:
    """The prompts an upstream is prefilling (sent, no first token yet), so that each
    answer's time to first token is measured against the prompt tokens prefilled with
    it, as admission predicts it (``admission/work.py``), not against its own alone."""

    __slots__ = ("sent", "tokens")

    def __init__(self) -> None:
        #: Prompt tokens of the requests it is prefilling now, and sent to it in all.
        self.tokens = 0
        self.sent = 0

    def begin(self, prompt_tokens: int) -> Prefill:
        prefill = Prefill(self, prompt_tokens, self.tokens, self.sent, time.monotonic())
        self.tokens += prompt_tokens
        self.sent += prompt_tokens
        return prefill


class Prefill:
    """One request's prompt at an upstream, from its sending to its first token."""

    __slots__ = ("_ahead", "_before", "_ledger", "group", "prompt_tokens", "sent_at")

    def __init__(
        self, ledger: PrefillLedger, prompt_tokens: int, ahead: int, before: int, now: float
    ) -> None:
        self._ledger = ledger
        self.prompt_tokens = prompt_tokens
        self._ahead = ahead
        self._before = before
        self.sent_at = now
        #: Set by :meth:`done`: the prompt tokens prefilled with it, its own included.
        self.group: tuple[int, int] | None = None

    def done(self) -> None:
        """Its first token came, or it ended without one (only the first call counts):
        ``group`` is (its own and those it found being prefilled, and those sent after it
        meanwhile)."""
        if self.group is not None:
            return
        self._ledger.tokens -= self.prompt_tokens
        later = self._ledger.sent - self._before - self.prompt_tokens
        self.group = (self.prompt_tokens + self._ahead, later)


def load_signals(text: str) -> tuple[float | None, float | None, float | None]:
    """Requests waiting inside an engine, its KV use, and how many it runs at once (when
    it says so), from its Prometheus text."""
    waiting: float | None = None
    kv: float | None = None
    seats: float | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError):
        return None, None, None
    for family in families:
        for sample in family.samples:
            if sample.name in WAITING_GAUGES:
                waiting = (waiting or 0.0) + float(sample.value)
            elif sample.name in KV_GAUGES:
                kv = max(kv or 0.0, float(sample.value))
            elif sample.name in SEAT_GAUGES:
                seats = float(sample.value)
    return waiting, kv, seats


def split_models(data: object) -> tuple[list[dict[str, object]], list[str]]:
    """An upstream's /v1/models entries: its chat models' and its embedding models' names
    (``task: "embed"``, as a Sluicegate and vLLM mark them: chat is not routed to them)."""
    entries = (
        [m for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []
    )
    embed = [str(m["id"]) for m in entries if m.get("task") in ("embed", "embedding")]
    return [m for m in entries if str(m["id"]) not in embed], embed


def context_length(entry: dict[str, object]) -> int | None:
    """The context a model of an upstream's /v1/models takes: ``max_model_len`` (vLLM,
    SGLang, Sluicegate), else llama.cpp's ``meta.n_ctx`` or ``meta.n_ctx_train``."""
    meta = entry.get("meta")
    found = [entry.get("max_model_len")]
    if isinstance(meta, dict):
        found += [meta.get("n_ctx"), meta.get("n_ctx_train")]
    for value in found:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _ewma(current: float | None, value: float, alpha: float) -> float:
    return value if current is None else current + alpha * (value - current)
