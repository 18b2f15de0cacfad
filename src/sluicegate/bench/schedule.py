"""The arrival schedule: every request of a run, planned up front from a seed.

The schedule is a pure function of ``(scenario, seed, capacity_rps, duration)``: the same
inputs give the same send times, tenants, client classes, lengths and request bodies.
Independent random streams are used for arrival times and for request attributes, so
changing, say, the slow-reader fraction does not move a single arrival.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from typing import Any

from sluicegate.bench.scenario import (
    FixedLength,
    LogNormalLength,
    MixtureLength,
    Scenario,
    Stage,
    UniformLength,
)

# Common English words that most BPE tokenizers encode as one token each (with the
# leading space); the prompt-length calibration corrects for the rest.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "river",
    "gate",
    "flow",
    "stream",
    "queue",
    "token",
    "reader",
    "batch",
]


class ClientClass(enum.StrEnum):
    """How a client reads its stream."""

    NORMAL = "normal"
    SLOW = "slow"
    DISCONNECT = "disconnect"


@dataclass(slots=True, frozen=True)
class StagePlan:
    """One stage as planned: its offered rate and its window in run time."""

    index: int
    offered_rps: float
    start_seconds: float
    end_seconds: float
    capacity_multiplier: float | None = None

    @property
    def duration_seconds(self) -> float:
        return self.end_seconds - self.start_seconds


@dataclass(slots=True, frozen=True)
class PlannedRequest:
    """One request as planned: when it is sent, by whom, how it reads, how long it is."""

    index: int
    stage_index: int
    send_offset_seconds: float
    tenant: str
    client_class: ClientClass
    target_prompt_tokens: int
    max_tokens: int
    disconnect_after_tokens: int | None
    read_tokens_per_second: float | None
    prompt_seed: int


@dataclass(slots=True, frozen=True)
class PromptModel:
    """Prompt tokens ≈ overhead + tokens_per_word · words (measured or given)."""

    tokens_per_word: float = 1.0
    overhead_tokens: float = 0.0

    def words_for(self, num_tokens: int) -> int:
        return max(1, round((num_tokens - self.overhead_tokens) / self.tokens_per_word))


@dataclass(slots=True)
class Schedule:
    """The stages and the requests of one run, in send order."""

    seed: int
    stages: list[StagePlan]
    requests: list[PlannedRequest]
    truncated: bool = False

    @property
    def arrival_window_seconds(self) -> float:
        return self.stages[-1].end_seconds if self.stages else 0.0


Length = FixedLength | UniformLength | LogNormalLength | MixtureLength


def draw_length(dist: Length, rng: random.Random) -> int:
    """One integer draw from a length distribution (clamped where it says so)."""
    if isinstance(dist, FixedLength):
        return dist.value
    if isinstance(dist, UniformLength):
        return rng.randint(dist.min, dist.max)
    if isinstance(dist, LogNormalLength):
        value = rng.lognormvariate(math.log(dist.median), dist.sigma)
        return min(dist.max, max(dist.min, round(value)))
    weights = [c.weight for c in dist.components]
    component = rng.choices(dist.components, weights=weights)[0]
    return draw_length(component.length, rng)


def interarrival_seconds(scenario: Scenario, rate_rps: float, rng: random.Random) -> float:
    """One gap between arrivals at ``rate_rps`` (mean ``1 / rate_rps``)."""
    process = scenario.arrival.process
    if process == "poisson":
        return rng.expovariate(rate_rps)
    if process == "gamma":
        shape = scenario.arrival.gamma_shape
        return rng.gammavariate(shape, 1.0 / (shape * rate_rps))
    return 1.0 / rate_rps


def plan_stages(
    scenario: Scenario, capacity_rps: float | None, duration_seconds: float | None
) -> list[StagePlan]:
    """Stages with absolute rates, durations scaled to ``duration_seconds`` when given."""
    if scenario.needs_capacity and capacity_rps is None:
        raise ValueError(
            f"scenario {scenario.name!r} gives rates as multiples of capacity: "
            "measure it (bench capacity) or pass --capacity-rps"
        )
    scale = 1.0 if duration_seconds is None else duration_seconds / scenario.total_stage_seconds
    plans = []
    start = 0.0
    for index, stage in enumerate(scenario.stages):
        end = start + stage.duration_seconds * scale
        plans.append(
            StagePlan(index, _rate(stage, capacity_rps), start, end, stage.capacity_multiplier)
        )
        start = end
    return plans


def _rate(stage: Stage, capacity_rps: float | None) -> float:
    if stage.rate_rps is not None:
        return stage.rate_rps
    assert stage.capacity_multiplier is not None and capacity_rps is not None
    return stage.capacity_multiplier * capacity_rps


def _stream(seed: int, purpose: str) -> random.Random:
    # String seeds are hashed (SHA-512) by random.Random: stable across runs and platforms.
    return random.Random(f"sluicegate-bench:{seed}:{purpose}")


def build_schedule(
    scenario: Scenario,
    *,
    seed: int | None = None,
    capacity_rps: float | None = None,
    duration_seconds: float | None = None,
) -> Schedule:
    """Plan every request of a run.  Deterministic in its arguments."""
    seed = scenario.seed if seed is None else seed
    stages = plan_stages(scenario, capacity_rps, duration_seconds)
    arrivals = _stream(seed, "arrivals")
    attributes = _stream(seed, "requests")
    tenants = scenario.tenants
    weights = [t.weight for t in tenants]
    slow = scenario.slow_readers
    disconnects = scenario.disconnects
    max_requests = scenario.limits.max_requests
    requests: list[PlannedRequest] = []
    truncated = False
    for stage in stages:
        t = stage.start_seconds
        while True:
            t += interarrival_seconds(scenario, stage.offered_rps, arrivals)
            if t >= stage.end_seconds:
                break
            if len(requests) >= max_requests:
                truncated = True
                break
            # Always the same draws in the same order, whatever the outcome.
            tenant = attributes.choices(tenants, weights=weights)[0]
            u = attributes.random()
            prompt_tokens = draw_length(scenario.prompt_tokens, attributes)
            max_tokens = draw_length(scenario.output_tokens, attributes)
            after = draw_length(disconnects.after_tokens, attributes)
            prompt_seed = attributes.getrandbits(32)
            if u < slow.fraction:
                client_class = ClientClass.SLOW
            elif u < slow.fraction + disconnects.fraction:
                client_class = ClientClass.DISCONNECT
            else:
                client_class = ClientClass.NORMAL
            is_disconnect = client_class is ClientClass.DISCONNECT
            requests.append(
                PlannedRequest(
                    index=len(requests),
                    stage_index=stage.index,
                    send_offset_seconds=t,
                    tenant=tenant.name,
                    client_class=client_class,
                    target_prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens,
                    disconnect_after_tokens=min(after, max_tokens) if is_disconnect else None,
                    read_tokens_per_second=(
                        slow.tokens_per_second if client_class is ClientClass.SLOW else None
                    ),
                    prompt_seed=prompt_seed,
                )
            )
        if truncated:
            break
    return Schedule(seed, stages, requests, truncated)


def prompt_text(num_words: int, prompt_seed: int, index: int) -> str:
    """Synthetic prompt of ``num_words`` words; unique per request (no prefix-cache luck)."""
    words = random.Random(prompt_seed).choices(_WORDS, k=num_words)
    if num_words > 1:
        words[0] = f"r{index}"
    return " ".join(words)


def shared_system_prompt(num_words: int, seed: int) -> str:
    """The system prompt every request of a scenario shares (the same for a seed)."""
    return " ".join(random.Random(f"system-{seed}").choices(_WORDS, k=num_words))


def request_body(
    scenario: Scenario, planned: PlannedRequest, model: str, prompt_model: PromptModel
) -> dict[str, Any]:
    """The JSON body of a planned request (streamed, ``ignore_eos``, fixed ``max_tokens``)."""
    text = prompt_text(
        prompt_model.words_for(planned.target_prompt_tokens), planned.prompt_seed, planned.index
    )
    stream_options: dict[str, Any] = {"include_usage": True}
    if scenario.continuous_usage_stats:
        stream_options["continuous_usage_stats"] = True
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": planned.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": stream_options,
        "seed": planned.prompt_seed,
        **scenario.extra_body,
    }
    if scenario.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        if scenario.shared_system_prompt_words:
            system = shared_system_prompt(scenario.shared_system_prompt_words, scenario.seed)
            body["messages"].insert(0, {"role": "system", "content": system})
    else:
        body["prompt"] = text
    return body
