"""The scenario: what load to offer, as a validated pydantic model read from YAML.

A scenario names its arrival process, its rate stages, the prompt and output length
distributions, the mix of client classes (normal, slow readers, disconnecting), the
tenants and their weights, and the service-level objectives that goodput and QoE are
measured against.  Built-in scenarios live in ``bench/scenarios/*.yaml``; any YAML file
with the same schema works too.  Every problem is reported with the field's path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCENARIO_PACKAGE = "sluicegate.bench"
SCENARIO_FOLDER = "scenarios"


class ScenarioError(ValueError):
    """A scenario could not be found, read or validated; the message says what and where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------- distributions
class FixedLength(_Strict):
    """Always ``value`` tokens."""

    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)


class UniformLength(_Strict):
    """Uniform integers in ``[min, max]``."""

    kind: Literal["uniform"] = "uniform"
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> UniformLength:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class LogNormalLength(_Strict):
    """Log-normal with the given median and log-space ``sigma``, clamped to ``[min, max]``."""

    kind: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0.0)
    sigma: float = Field(ge=0.0, le=4.0)
    min: int = Field(1, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormalLength:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


SimpleLength = Annotated[FixedLength | UniformLength | LogNormalLength, Field(discriminator="kind")]


class MixtureComponent(_Strict):
    weight: float = Field(gt=0.0)
    length: SimpleLength

    @field_validator("length", mode="before")
    @classmethod
    def _int_is_fixed(cls, value: Any) -> Any:
        return _shorthand(value)


class MixtureLength(_Strict):
    """Pick a component by weight, then draw from it (e.g. 10% long prompts)."""

    kind: Literal["mixture"] = "mixture"
    components: list[MixtureComponent] = Field(min_length=1)


LengthDistribution = Annotated[
    FixedLength | UniformLength | LogNormalLength | MixtureLength, Field(discriminator="kind")
]


def _shorthand(value: Any) -> Any:
    """A bare integer means a fixed length."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"kind": "fixed", "value": value}
    return value


def max_length(dist: FixedLength | UniformLength | LogNormalLength | MixtureLength) -> int:
    """The largest value ``dist`` can produce."""
    if isinstance(dist, FixedLength):
        return dist.value
    if isinstance(dist, MixtureLength):
        return max(max_length(c.length) for c in dist.components)
    return dist.max


# --------------------------------------------------------------------- load
class Arrival(_Strict):
    """Open-loop arrivals: when requests are sent never depends on when others finish."""

    process: Literal["poisson", "gamma", "constant"] = "poisson"
    gamma_shape: float = Field(
        0.5,
        gt=0.0,
        description="Gamma inter-arrival shape k: below 1 is burstier than Poisson "
        "(coefficient of variation 1/sqrt(k)); 1 is Poisson.",
    )


class Stage(_Strict):
    """A stretch of time at one offered rate: absolute, or a multiple of capacity."""

    duration_seconds: float = Field(gt=0.0)
    rate_rps: float | None = Field(None, gt=0.0)
    capacity_multiplier: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _one_rate(self) -> Stage:
        if (self.rate_rps is None) == (self.capacity_multiplier is None):
            raise ValueError(
                "give exactly one of rate_rps (requests/s) or capacity_multiplier "
                "(a multiple of the measured or --capacity-rps capacity)"
            )
        return self


class SlowReaders(_Strict):
    """Clients that read at a fixed token rate through a small socket receive buffer."""

    fraction: float = Field(0.0, ge=0.0, le=1.0)
    tokens_per_second: float = Field(5.0, gt=0.0)
    receive_buffer_bytes: int = Field(4096, ge=1024)
    read_chunk_bytes: int = Field(512, ge=64, description="Bytes per paced recv call.")


class Disconnects(_Strict):
    """Clients that close the connection after receiving ``after_tokens`` tokens."""

    fraction: float = Field(0.0, ge=0.0, le=1.0)
    after_tokens: LengthDistribution = Field(default_factory=lambda: FixedLength(value=8))

    @field_validator("after_tokens", mode="before")
    @classmethod
    def _int_is_fixed(cls, value: Any) -> Any:
        return _shorthand(value)


class TenantLoad(_Strict):
    """One tenant of the load: its share of requests and its API key."""

    name: str = Field(min_length=1, max_length=64)
    weight: float = Field(1.0, gt=0.0)
    api_key: str | None = Field(None, description="Sent as 'Authorization: Bearer <key>'.")


class ServiceObjectives(_Strict):
    """What counts as good service (goodput) and the expected reading pace (QoE)."""

    ttft_seconds: float = Field(1.0, gt=0.0, description="Time to first token objective.")
    tpot_seconds: float = Field(0.1, gt=0.0, description="Mean time per output token objective.")
    qoe_tokens_per_second: float = Field(
        20.0, gt=0.0, description="Pace of the reader that QoE measures delivery against."
    )


class RetryAfter(_Strict):
    """On a refusal that says when to come back (``retry-after-ms``, ``Retry-After``, or an
    error event's ``retry_after_ms``: R), retry once, R seconds after the refusal came."""

    retry_once: bool = True
    max_wait_seconds: float = Field(10.0, ge=0.0, description="Do not retry when R is larger.")
    on_time_tolerance_seconds: float = Field(
        0.05,
        ge=0.0,
        description="A retry sent at most this long after its advertised time counts as "
        "made at that time (the retry-success figure counts only those).",
    )


class Targets(_Strict):
    """What a run should show, each checked in the summary's targets table (met or not).

    Stages are compared by offered rate: the *base* stage is the first at the lowest rate,
    the *peak* stage the first at the highest.  Unset targets are not checked.
    """

    ttft_p99_ratio_max: float | None = Field(
        None, gt=0.0, description="Admitted TTFT p99 at the peak stage over the base stage."
    )
    tpot_p99_within_objective: bool = Field(
        False, description="Admitted TPOT p99 at the peak stage at most slo.tpot_seconds."
    )
    goodput_capacity_fraction_min: float | None = Field(
        None, gt=0.0, description="Goodput at the peak stage over the capacity, at least."
    )
    refusal_p99_seconds_below: float | None = Field(
        None, gt=0.0, description="Refusal latency p99 (sent to complete 429) at the peak stage."
    )
    resident_memory_ratio_tolerance: float | None = Field(
        None,
        ge=0.0,
        description="Peak RSS in the peak stage within this fraction of that in the base stage.",
    )
    retry_admitted_fraction_min: float | None = Field(
        None, gt=0.0, le=1.0, description="Retries made at the advertised time admitted, at least."
    )


class Limits(_Strict):
    """Hard bounds, so every run stops by itself."""

    max_requests: int = Field(20_000, ge=1, description="Requests planned, at most.")
    max_in_flight: int = Field(
        1000, ge=1, description="Open connections at most; an arrival beyond is recorded unsent."
    )
    request_timeout_seconds: float = Field(120.0, gt=0.0, description="Socket read timeout.")
    drain_timeout_seconds: float = Field(
        30.0, ge=0.0, description="After the last arrival, wait this long, then cut the rest."
    )


class CapacitySearch(_Strict):
    """How ``bench capacity`` looks for the knee (flags override these)."""

    start_rps: float = Field(1.0, gt=0.0)
    growth: float = Field(2.0, gt=1.0, description="Rate multiplier between ramp trials.")
    trial_seconds: float = Field(5.0, gt=0.0, description="Arrival window of one trial.")
    drain_seconds: float | None = Field(
        None, ge=0.0, description="Wait after a trial's arrivals (default: trial_seconds)."
    )
    precision: float = Field(
        0.1, gt=0.0, description="Stop bisecting when (high - low) / low is at most this."
    )
    max_trials: int = Field(12, ge=2)
    max_rps: float = Field(10_000.0, gt=0.0)
    max_ttft_growth: float = Field(
        0.05,
        ge=0.0,
        description="TTFT growth across a trial (seconds per second) beyond which the queue "
        "is growing without bound.",
    )
    min_goodput_fraction: float = Field(0.9, ge=0.0, le=1.0)
    max_rejected_fraction: float = Field(0.01, ge=0.0, le=1.0)


class Scenario(_Strict):
    """A complete load description.  See ``docs/bench.md`` for every field."""

    name: str = Field(min_length=1)
    description: str = ""
    endpoint: Literal["chat", "completions"] = "chat"
    model: str | None = Field(None, description="Model name; default: first of /v1/models.")
    seed: int = 0
    arrival: Arrival = Field(default_factory=Arrival)
    stages: list[Stage] = Field(min_length=1)
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    slow_readers: SlowReaders = Field(default_factory=SlowReaders)
    disconnects: Disconnects = Field(default_factory=Disconnects)
    tenants: list[TenantLoad] = Field(
        default_factory=lambda: [TenantLoad(name="default")], min_length=1
    )
    slo: ServiceObjectives = Field(default_factory=ServiceObjectives)
    retry_after: RetryAfter = Field(default_factory=RetryAfter)
    targets: Targets = Field(default_factory=Targets)
    limits: Limits = Field(default_factory=Limits)
    capacity: CapacitySearch = Field(default_factory=CapacitySearch)
    tokens_per_word: float | None = Field(
        None,
        gt=0.0,
        description="Prompt tokens per synthetic word; default: measured on the target.",
    )
    shared_system_prompt_words: int = Field(
        0,
        ge=0,
        description="Chat: every request starts with the same system prompt of this "
        "many synthetic words (what prefix caching reuses); 0: none.",
    )
    continuous_usage_stats: bool = Field(
        True, description="Ask for usage in every chunk (exact token counts per event)."
    )
    extra_body: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prompt_tokens", "output_tokens", mode="before")
    @classmethod
    def _int_is_fixed(cls, value: Any) -> Any:
        return _shorthand(value)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        total = self.slow_readers.fraction + self.disconnects.fraction
        if total > 1.0:
            raise ValueError(
                f"slow_readers.fraction + disconnects.fraction must be at most 1; got {total:g}"
            )
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique; got {names}")
        return self

    @property
    def needs_capacity(self) -> bool:
        """True when a stage's rate is a multiple of capacity."""
        return any(s.capacity_multiplier is not None for s in self.stages)

    @property
    def total_stage_seconds(self) -> float:
        return sum(s.duration_seconds for s in self.stages)


# ------------------------------------------------------------------ loading
def builtin_scenario_names() -> list[str]:
    """Names of the scenarios shipped with the package."""
    root = resources.files(SCENARIO_PACKAGE).joinpath(SCENARIO_FOLDER)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ScenarioError(f"scenario file {name_or_path} does not exist")
        return parse_scenario(path.read_text(encoding="utf-8"), str(path))
    resource = resources.files(SCENARIO_PACKAGE).joinpath(SCENARIO_FOLDER, f"{name_or_path}.yaml")
    if not resource.is_file():
        known = ", ".join(builtin_scenario_names())
        raise ScenarioError(
            f"unknown scenario {name_or_path!r}: give a built-in name ({known}) "
            "or the path of a YAML file"
        )
    return parse_scenario(resource.read_text(encoding="utf-8"), f"{name_or_path} (built-in)")


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    """Validate YAML text as a :class:`Scenario`; errors name the source and each field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"scenario {source} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"scenario {source} must be a mapping of fields")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"scenario {source} is invalid:\n{describe_errors(exc)}") from None


def describe_errors(exc: ValidationError) -> str:
    """One line per problem: the field's path, what is wrong, and the value given."""
    lines = []
    for error in exc.errors():
        loc = _location(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (check the spelling; see docs/bench.md for the schema)"
        elif error["type"] == "union_tag_invalid":
            message = "unknown kind; use one of fixed, uniform, lognormal, mixture"
        given = error.get("input")
        suffix = "" if isinstance(given, dict) or given is None else f" (got {given!r})"
        lines.append(f"  {loc or '<top>'}: {message}{suffix}")
    return "\n".join(lines)


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    kinds = {"fixed", "uniform", "lognormal", "mixture"}
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in kinds:
            continue  # the discriminator tag pydantic adds to the path
        else:
            out += f".{part}" if out else str(part)
    return out
