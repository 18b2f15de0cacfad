"""Drive a schedule at a target: open-loop arrivals, one thread per request, bounded.

The dispatcher (the calling thread) sleeps until each planned send time and starts a
client thread; it never waits for a completion, so a slow or stuck request cannot delay
the next arrival (open loop).  When more than ``limits.max_in_flight`` connections are
open, an arrival is recorded as not sent rather than delayed.  After the last arrival the
run waits up to ``limits.drain_timeout_seconds`` for requests to finish, then cuts the
rest (their sockets are shut down), so every run stops by itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console

from sluicegate.bench.client import ClientContext, Target, execute
from sluicegate.bench.progress import LiveCounters, RunDisplay
from sluicegate.bench.records import Attempt, Outcome, Sample, SeriesPoint
from sluicegate.bench.scenario import Scenario
from sluicegate.bench.schedule import PlannedRequest, PromptModel, Schedule, StagePlan, prompt_text
from sluicegate.bench.scrape import MetricsScraper, counter_delta
from sluicegate.bench.stats import GroupStats, summarise_run

#: Used when the target cannot be measured (its prompt-token count is unknown).
FALLBACK_TOKENS_PER_WORD = 1.3
_CALIBRATION_WORDS = (8, 64)


class BenchError(RuntimeError):
    """The bench cannot proceed (target unreachable, no model); the message says why."""


@dataclass(slots=True)
class Calibration:
    """How synthetic words map to prompt tokens on this target, and what it cost."""

    tokens_per_word: float
    overhead_tokens: float = 0.0
    measured: bool = False
    note: str = ""
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def prompt_model(self) -> PromptModel:
        return PromptModel(self.tokens_per_word, self.overhead_tokens)


@dataclass(slots=True)
class RunResult:
    """Everything one run at one target produced."""

    label: str
    target_url: str
    scenario: Scenario
    seed: int
    model: str
    started_at_unix: float
    capacity_rps: float | None
    stages: list[StagePlan]
    samples: list[Sample]
    series: list[SeriesPoint]
    counters_before: dict[str, float]
    counters_after: dict[str, float]
    calibration: Calibration
    wall_seconds: float
    truncated: bool = False
    interrupted: bool = False
    num_cut: int = 0
    server_config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, GroupStats]:
        scenario = self.scenario
        return summarise_run(self.samples, self.stages, scenario.slo, scenario.retry_after)

    @property
    def counters_delta(self) -> dict[str, float]:
        return counter_delta(self.counters_before, self.counters_after)


class Runner:
    """Runs schedules of one scenario against one target."""

    def __init__(
        self,
        target: Target,
        scenario: Scenario,
        *,
        api_key: str | None = None,
        model: str | None = None,
        console: Console | None = None,
        show_progress: bool = True,
        scrape_interval_seconds: float = 0.5,
        more_targets: tuple[Target, ...] = (),
    ) -> None:
        self.target = target
        #: Servers sharing the load with ``target`` (its metrics are the ones scraped).
        self.more_targets = more_targets
        self.scenario = scenario
        self.api_key = api_key
        self.console = console or Console(stderr=True)
        self.show_progress = show_progress
        self.scrape_interval_seconds = scrape_interval_seconds
        self._model = model or scenario.model
        self._calibration: Calibration | None = None

    # ------------------------------------------------------------------ setup
    @property
    def _headers(self) -> dict[str, str]:
        key = self.scenario.tenants[0].api_key or self.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    def model(self) -> str:
        """The model to request: the scenario's, or the first the target lists."""
        if self._model is None:
            url = self.target.base_url + "/v1/models"
            try:
                response = httpx.get(url, headers=self._headers, timeout=10.0)
                response.raise_for_status()
                self._model = str(response.json()["data"][0]["id"])
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise BenchError(
                    f"cannot list the models at {url} ({exc}); is the server up? "
                    "Or name the model with --model"
                ) from None
        return self._model

    def calibration(self) -> Calibration:
        """Measure prompt tokens per synthetic word on the target (two tiny requests)."""
        if self._calibration is None:
            self._calibration = self._calibrate()
        return self._calibration

    def _calibrate(self) -> Calibration:
        given = self.scenario.tokens_per_word
        if given is not None:
            return Calibration(given, note="tokens_per_word given by the scenario")
        model = self.model()
        counts: list[int] = []
        calibration = Calibration(FALLBACK_TOKENS_PER_WORD)
        with httpx.Client(timeout=60.0) as client:
            for words in _CALIBRATION_WORDS:
                text = prompt_text(words, words, 0)
                body: dict[str, Any] = {"model": model, "max_tokens": 1, "stream": False}
                if self.scenario.endpoint == "chat":
                    body["messages"] = [{"role": "user", "content": text}]
                else:
                    body["prompt"] = text
                url = self.target.base_url + self.target.path(self.scenario.endpoint)
                calibration.num_requests += 1
                try:
                    response = client.post(url, json=body, headers=self._headers)
                    usage = response.json()["usage"] if response.status_code == 200 else None
                except (httpx.HTTPError, ValueError, KeyError):
                    usage = None
                if not isinstance(usage, dict):
                    calibration.note = (
                        f"calibration request failed; assuming {FALLBACK_TOKENS_PER_WORD} "
                        "tokens per word"
                    )
                    return calibration
                counts.append(int(usage["prompt_tokens"]))
                calibration.prompt_tokens += int(usage["prompt_tokens"])
                calibration.completion_tokens += int(usage.get("completion_tokens", 0))
        slope = (counts[1] - counts[0]) / (_CALIBRATION_WORDS[1] - _CALIBRATION_WORDS[0])
        if slope <= 0:
            calibration.note = "calibration gave no slope; assuming the fallback"
            return calibration
        calibration.tokens_per_word = slope
        calibration.overhead_tokens = max(0.0, counts[0] - slope * _CALIBRATION_WORDS[0])
        calibration.measured = True
        return calibration

    # -------------------------------------------------------------------- run
    def run(
        self,
        schedule: Schedule,
        label: str,
        *,
        capacity_rps: float | None = None,
        drain_timeout_seconds: float | None = None,
        settle_seconds: float = 1.0,
    ) -> RunResult:
        """Send every planned request on time; return the samples and server series.

        ``drain_timeout_seconds`` overrides the scenario's; ``settle_seconds`` is the
        pause before the final ``/metrics`` read, so the server has counted cut streams.
        """
        model = self.model()
        calibration = self.calibration()
        limits = self.scenario.limits
        drain_seconds = (
            limits.drain_timeout_seconds if drain_timeout_seconds is None else drain_timeout_seconds
        )
        started_unix = time.time()
        scraper = MetricsScraper(
            self.target.base_url, time.monotonic(), self.scrape_interval_seconds
        )
        before = scraper.snapshot()
        run_start = time.monotonic()
        scraper.run_start = run_start
        scraper.start()
        ctx = ClientContext(
            self.target,
            self.scenario,
            model,
            calibration.prompt_model,
            run_start,
            self.api_key,
            more_targets=self.more_targets,
        )
        planned = schedule.requests
        samples: list[Sample | None] = [None] * len(planned)
        counters = LiveCounters(len(planned))
        threads: list[threading.Thread] = []
        interrupted = False
        num_cut = 0

        def client(request: PlannedRequest) -> None:
            try:
                sample = execute(request, ctx)
            except Exception as exc:  # a bench bug must not lose the sample
                sample = Sample(request, [_failed_attempt(request, run_start, exc)])
            samples[request.index] = sample
            counters.finished(sample)

        title = f"{label}: {self.scenario.name}"
        display = RunDisplay(
            self.console, title, counters, lambda: scraper.latest, self.show_progress
        )
        try:
            with display:
                try:
                    for request in planned:
                        delay = run_start + request.send_offset_seconds - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        if counters.num_in_flight >= limits.max_in_flight:
                            samples[request.index] = Sample(
                                request, not_sent_reason="max_in_flight connections open"
                            )
                            continue
                        counters.sent()
                        thread = threading.Thread(
                            target=client,
                            args=(request,),
                            name=f"bench-{request.index}",
                            daemon=True,
                        )
                        thread.start()
                        threads.append(thread)
                    window_end = run_start + schedule.arrival_window_seconds
                    time.sleep(max(0.0, window_end - time.monotonic()))
                    num_cut = _drain(threads, ctx, drain_seconds)
                except KeyboardInterrupt:
                    interrupted = True
                    num_cut = _drain(threads, ctx, 0.0)
        finally:
            ctx.stop.set()
            wall_seconds = time.monotonic() - run_start
            # Let the server record the last finishes (cut streams) before the final read.
            time.sleep(settle_seconds)
            after = scraper.snapshot()
            scraper.stop()
        final = [
            s if s is not None else Sample(p, not_sent_reason="run stopped")
            for s, p in zip(samples, planned, strict=True)
        ]
        result = RunResult(
            label=label,
            target_url=self.target.base_url,
            scenario=self.scenario,
            seed=schedule.seed,
            model=model,
            started_at_unix=started_unix,
            capacity_rps=capacity_rps,
            stages=schedule.stages,
            samples=final,
            series=scraper.series,
            counters_before=before.counters() if before else {},
            counters_after=after.counters() if after else {},
            calibration=calibration,
            wall_seconds=wall_seconds,
            truncated=schedule.truncated,
            interrupted=interrupted,
            num_cut=num_cut,
        )
        if schedule.truncated:
            result.notes.append(f"schedule truncated at limits.max_requests={limits.max_requests}")
        if num_cut:
            result.notes.append(
                f"{num_cut} requests still open after the drain window "
                f"({drain_seconds:g}s) were cut"
            )
        if before is None:
            result.notes.append("the target has no Prometheus /metrics: no server series")
        return result


def _drain(threads: list[threading.Thread], ctx: ClientContext, timeout_seconds: float) -> int:
    """Wait for the client threads up to the timeout, then cut what is still open."""
    deadline = time.monotonic() + timeout_seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in threads if t.is_alive()]
    if not alive:
        return 0
    ctx.cut_all()
    for thread in alive:
        with contextlib.suppress(RuntimeError):
            thread.join(10.0)
    return len(alive)


def _failed_attempt(request: PlannedRequest, run_start: float, exc: Exception) -> Attempt:
    return Attempt(
        sent_offset_seconds=time.monotonic() - run_start,
        outcome=Outcome.ERROR,
        error=f"bench client failed: {type(exc).__name__}: {exc}",
    )
