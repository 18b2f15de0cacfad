"""The configured pipelines, built once at start-up, and what one does for a request:
its prompt (system prompt, retrieved context), its input guard, and its output stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluicegate.metrics.registry import Metrics
from sluicegate.pipeline.chain import StageChain
from sluicegate.pipeline.checks import Check, Trip, build_check, first_trip
from sluicegate.pipeline.retrieve import Retrieved, Retriever
from sluicegate.pipeline.stages import FormatStage, GuardStage, Stage
from sluicegate.pipeline_settings import PipelineSettings

Messages = list[dict[str, str]]


@dataclass(slots=True)
class Pipeline:
    settings: PipelineSettings
    retriever: Retriever | None
    input_checks: list[Check]
    #: The checks of each guard stage, by stage name.
    stage_checks: dict[str, list[Check]]
    #: Trips so far: ``input`` (prompts refused) and ``output`` (answers stopped).
    trips: dict[str, int] = field(default_factory=lambda: {"input": 0, "output": 0})

    def count_trip(self, trip: Trip, where: str, metrics: Metrics) -> None:
        self.trips[where] += 1
        metrics.guard_trips_total.labels(self.name, trip.check, where).inc()
        if trip.timed_out:
            metrics.guard_check_timeouts_total.labels(self.name, trip.check, where).inc()

    def snapshot(self) -> dict[str, object]:
        """For ``/v1/stats``."""
        return {
            "name": self.name,
            "model": self.settings.model,
            "stages": [s.name for s in self.settings.stages],
            "passages": None if self.retriever is None else len(self.retriever.passages),
            "input_guard": self.settings.input_guard is not None,
            "trips": dict(self.trips),
        }

    @property
    def name(self) -> str:
        return self.settings.name

    def messages(self, messages: Messages) -> tuple[Messages, Retrieved | None]:
        """The conversation the model sees: the pipeline's system prompt and the passages
        retrieved for the last user message, before the client's messages."""
        first: Messages = []
        if self.settings.system_prompt:
            first.append({"role": "system", "content": self.settings.system_prompt})
        retrieved = None
        if self.retriever is not None:
            query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            retrieved = self.retriever.retrieve(query)
            if (context := self.retriever.context_message(retrieved)) is not None:
                first.append({"role": "system", "content": context})
        return first + messages, retrieved

    async def check_input(
        self,
        text: str,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
    ) -> Trip | None:
        """The input guard over windows of the prompt (in the model's tokens)."""
        guard = self.settings.input_guard
        if guard is None or not text:
            return None
        ids = encode(text)
        start = 0
        while True:
            window = decode(ids[start : start + guard.window_tokens])
            trip = await first_trip(self.input_checks, window, guard.check_timeout_seconds)
            if trip is not None or start + guard.window_tokens >= len(ids):
                return trip
            start += guard.stride_tokens

    def chain(
        self,
        request_id: str,
        metrics: Metrics,
        abort: Callable[[], None],
        sources: list[str],
        resumed: bool,
    ) -> StageChain | None:
        """The request's output stages (None: the pipeline has none)."""
        if not self.settings.stages:
            return None
        histogram = metrics.guard_check_seconds.labels(self.name)

        def tripped(trip: Trip) -> None:
            abort()
            self.count_trip(trip, "output", metrics)

        stages: list[Stage] = []
        for stage in self.settings.stages:
            if stage.guard is not None:
                checks = self.stage_checks[stage.guard.name]
                stages.append(GuardStage(stage.guard, checks, tripped, histogram.observe))
            else:
                assert stage.format is not None
                stages.append(FormatStage(stage.format, sources, resumed))
        return StageChain(request_id, stages, self.settings.channel_tokens, abort)


def build_pipeline(settings: PipelineSettings) -> Pipeline:
    retriever = Retriever(settings.retrieve) if settings.retrieve is not None else None
    guard = settings.input_guard
    input_checks = [build_check(c) for c in guard.checks] if guard is not None else []
    stage_checks = {
        s.guard.name: [build_check(c) for c in s.guard.checks]
        for s in settings.stages
        if s.guard is not None
    }
    return Pipeline(settings, retriever, input_checks, stage_checks)


class Pipelines:
    """Every pipeline of this server, by name.  Read-only after start-up."""

    def __init__(self, settings: list[PipelineSettings]) -> None:
        started = time.perf_counter()
        self.by_name = {p.name: build_pipeline(p) for p in settings}
        self.build_seconds = time.perf_counter() - started

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    @property
    def stage_names(self) -> list[str]:
        """Every stage name (the ``stage`` label's values, beside ``client``)."""
        settings = [p.settings for p in self.by_name.values()]
        return [n for n in stage_label_values(settings) if n != "client"]

    def get(self, name: str | None) -> Pipeline | None:
        return None if name is None else self.by_name.get(name)

    def snapshot(self) -> list[dict[str, object]]:
        return [p.snapshot() for p in self.by_name.values()]


def stage_label_values(settings: list[PipelineSettings]) -> list[str]:
    out: dict[str, None] = {"client": None}
    for pipeline in settings:
        out.update((s.name, None) for s in pipeline.stages)
    return list(out)


def check_pipeline_models(pipelines: Pipelines, served: list[str], upstream: bool) -> None:
    """No pipeline takes a served model's name; each generates with a served model (an
    upstream's models change at run time: checked per request there)."""
    for pipeline in pipelines.by_name.values():
        if pipeline.name in served:
            raise ValueError(f"pipeline {pipeline.name!r}: a served model has that name")
        model = pipeline.settings.model
        if model is not None and not upstream and model not in served:
            raise ValueError(
                f"pipeline {pipeline.name!r}: model {model!r} is not served "
                f"(served: {', '.join(served)})"
            )
