"""The live view of a run: a progress bar of arrivals and a table of what is happening."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sluicegate.bench.records import Outcome, Sample, SeriesPoint


class LiveCounters:
    """Counters the client threads update as requests finish.  Thread-safe."""

    def __init__(self, num_planned: int) -> None:
        self.num_planned = num_planned
        self.num_sent = 0
        self.num_in_flight = 0
        self.num_completed = 0
        self.num_rejected = 0
        self.num_disconnected = 0
        self.num_failed = 0
        self.num_tokens = 0
        self.recent_ttft_seconds: deque[float] = deque(maxlen=256)
        self._lock = threading.Lock()

    def sent(self) -> None:
        with self._lock:
            self.num_sent += 1
            self.num_in_flight += 1

    def finished(self, sample: Sample) -> None:
        with self._lock:
            self.num_in_flight -= 1
            for attempt in sample.attempts:
                self.num_tokens += attempt.completion_tokens
            first = sample.first
            if first is None:
                return
            if first.outcome is Outcome.COMPLETED:
                self.num_completed += 1
            elif first.outcome is Outcome.REJECTED:
                self.num_rejected += 1
            elif first.outcome is Outcome.DISCONNECTED:
                self.num_disconnected += 1
            else:
                self.num_failed += 1
            if first.ttft_seconds is not None:
                self.recent_ttft_seconds.append(first.ttft_seconds)

    def recent_ttft_p50(self) -> float | None:
        with self._lock:
            values = list(self.recent_ttft_seconds)
        return float(np.median(values)) if values else None


class RunDisplay:
    """A ``rich`` live display of one run (a no-op when disabled)."""

    def __init__(
        self,
        console: Console,
        title: str,
        counters: LiveCounters,
        latest_series: Callable[[], SeriesPoint | None],
        enabled: bool = True,
    ) -> None:
        self.counters = counters
        self.latest_series = latest_series
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            auto_refresh=False,
        )
        self.task = self.progress.add_task(title, total=counters.num_planned)
        self.live = Live(self, console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> RunDisplay:
        if self.enabled:
            self.live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.enabled:
            self.live.stop()

    def __rich__(self) -> RenderableType:
        c = self.counters
        self.progress.update(self.task, completed=c.num_sent)
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for column in (
            "open",
            "done",
            "429/503",
            "left",
            "failed",
            "tokens",
            "TTFT p50",
            "queued",
            "paused",
            "KV",
            "RSS",
        ):
            table.add_column(column, justify="right")
        ttft = c.recent_ttft_p50()
        point = self.latest_series()
        table.add_row(
            str(c.num_in_flight),
            str(c.num_completed),
            str(c.num_rejected),
            str(c.num_disconnected),
            str(c.num_failed),
            str(c.num_tokens),
            "-" if ttft is None else f"{ttft * 1000:.0f} ms",
            _fmt(point.requests_waiting if point else None, "{:.0f}"),
            _fmt(point.streams_paused if point else None, "{:.0f}"),
            _fmt(point.kv_cache_usage_ratio if point else None, "{:.0%}"),
            _fmt(
                point.resident_memory_bytes / 2**20
                if point and point.resident_memory_bytes is not None
                else None,
                "{:.0f} MiB",
            ),
        )
        return Group(self.progress.get_renderable(), table)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)
