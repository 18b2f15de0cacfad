"""The settings of pipelines: model names that retrieve, generate, guard and format
(``pipelines:`` in the config file; part of :class:`~sluicegate.config.Settings`).

See ``docs/pipelines.md``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Check types built in; anything else must be ``package.module:Class``.
BUILTIN_CHECKS = ("regex", "semantic")


def compile_linear(pattern: str) -> Any:
    """``pattern`` compiled by RE2 (linear-time matching); a ValueError saying why RE2
    cannot run it (backreferences, lookaround)."""
    import re2  # type: ignore[import-untyped]

    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as error:
        reason = error.args[0] if error.args else error
        raise ValueError(reason.decode() if isinstance(reason, bytes) else str(reason)) from None


def longest_match(pattern: str) -> int | None:
    """The most characters a match of ``pattern`` can span (None: no bound)."""
    # The standard library's own parser gives the width (not public API; typeshed has no
    # stubs for it).
    import re._constants as constants  # type: ignore[import-not-found]
    import re._parser as parser  # type: ignore[import-not-found]

    widest = parser.parse(pattern).getwidth()[1]
    return None if widest >= constants.MAXREPEAT else int(widest)


class CheckSettings(BaseModel):
    """One guard check: ``regex`` (patterns), ``semantic`` (topics by similarity) or a
    class of your own (``type: package.module:Class``, given ``options``)."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="regex, semantic, or package.module:Class")
    name: str | None = Field(None, description="Its label in metrics (default: its type).")
    patterns: list[str] = Field(
        default_factory=list, description="regex: trips when any matches (Python syntax)."
    )
    topics: dict[str, list[str]] = Field(
        default_factory=dict,
        description="semantic: banned topics, each described by a few example phrases.",
    )
    threshold: float = Field(
        0.6, gt=0.0, le=1.0, description="semantic: cosine similarity that trips."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="A custom check's keyword arguments."
    )
    max_match_chars: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="regex: the longest match to catch whole, for a pattern whose matches "
        "have no bound of their own (a+, \\w*); bounded patterns need none.",
    )

    @property
    def label(self) -> str:
        return self.name or self.type

    @model_validator(mode="after")
    def _check(self) -> CheckSettings:
        if self.type == "regex":
            if not self.patterns:
                raise ValueError("a regex check needs patterns")
            for pattern in self.patterns:
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"pattern {pattern!r}: {error}") from None
                try:
                    compile_linear(pattern)
                except ValueError as error:
                    raise ValueError(
                        f"pattern {pattern!r}: guards run patterns on RE2, in linear time "
                        f"(so that no input can stall the server), which cannot run this "
                        f"one: {error}"
                    ) from None
                if longest_match(pattern) is None and self.max_match_chars is None:
                    raise ValueError(
                        f"pattern {pattern!r} has matches of any length, and a guard holds "
                        "back only as much text as its longest match to catch it whole "
                        "before any of it is sent: set max_match_chars on this check (the "
                        "longest match it must catch), or bound the pattern ({1,40} for +)"
                    )
        elif self.type == "semantic":
            if not self.topics or not all(self.topics.values()):
                raise ValueError("a semantic check needs topics, each with example phrases")
        elif ":" not in self.type:
            raise ValueError(
                f"check type {self.type!r}: use one of {', '.join(BUILTIN_CHECKS)} "
                "or package.module:Class"
            )
        return self


class GuardSettings(BaseModel):
    """Checks over a sliding window of the output (in tokens), and what a trip sends."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("guard", description="The stage's name (metrics' stage label).")
    window_tokens: int = Field(16, ge=1, le=512, description="Tokens each check sees.")
    stride_tokens: int = Field(
        8,
        ge=1,
        description="Tokens between checks; the client sees each token at most "
        "this many tokens later than without the guard.",
    )
    replacement: str = Field(
        "I can't help with that.", description="Sent instead of the rest of the answer."
    )
    checks: list[CheckSettings] = Field(min_length=1)
    check_timeout_seconds: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="A check's deadline per window; past it the window trips (fails closed).",
    )

    @model_validator(mode="after")
    def _stride(self) -> GuardSettings:
        if self.stride_tokens > self.window_tokens:
            raise ValueError("stride_tokens must not exceed window_tokens")
        return self


class FormatSettings(BaseModel):
    """Text around the answer, and the sources it was retrieved from."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("format", description="The stage's name (metrics' stage label).")
    prefix: str = Field("", description="Sent before the answer's first text.")
    suffix: str = Field("", description="Sent after the answer's last text.")
    citations: bool = Field(
        False, description="End with the names of the documents retrieved for it."
    )


class StageSettings(BaseModel):
    """One output stage: exactly one of ``guard`` and ``format``."""

    model_config = ConfigDict(extra="forbid")

    guard: GuardSettings | None = None
    format: FormatSettings | None = None

    @model_validator(mode="after")
    def _one(self) -> StageSettings:
        if (self.guard is None) == (self.format is None):
            raise ValueError("a stage is exactly one of guard or format")
        return self

    @property
    def name(self) -> str:
        chosen = self.guard or self.format
        assert chosen is not None
        return chosen.name


class RetrieveSettings(BaseModel):
    """A BM25 index of a local folder, built at start-up; the best passages go into the
    prompt as a system message."""

    model_config = ConfigDict(extra="forbid")

    documents: Path = Field(description="A folder of .md and .txt files (searched recursively).")
    top_k: int = Field(3, ge=1, le=50, description="Passages put into the prompt.")
    passage_words: int = Field(120, ge=10, description="Documents are cut into passages this long.")
    max_context_chars: int = Field(
        2400, ge=100, description="At most this much retrieved text goes into the prompt."
    )
    instructions: str = Field(
        "Answer using the context below when it is relevant.",
        description="Put before the retrieved passages.",
    )


class InputGuardSettings(BaseModel):
    """Checks on the prompt before any work: a trip is a 400 with code content_filter."""

    model_config = ConfigDict(extra="forbid")

    window_tokens: int = Field(16, ge=1, le=512)
    stride_tokens: int = Field(8, ge=1)
    checks: list[CheckSettings] = Field(min_length=1)
    check_timeout_seconds: float = Field(1.0, gt=0.0, le=60.0)


class PipelineSettings(BaseModel):
    """A model name that retrieves, generates with a served model, then streams the
    output through its stages (each with a bounded channel in front of it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The model name clients ask for.")
    model: str | None = Field(None, description="The served model it generates with.")
    system_prompt: str | None = Field(None, description="Put first in every conversation.")
    retrieve: RetrieveSettings | None = None
    input_guard: InputGuardSettings | None = None
    stages: list[StageSettings] = Field(default_factory=list)
    channel_tokens: int = Field(
        64, ge=1, description="Tokens a stage's channel holds before the stage before waits."
    )

    @field_validator("stages")
    @classmethod
    def _unique(cls, stages: list[StageSettings]) -> list[StageSettings]:
        names = [s.name for s in stages]
        if len(set(names)) != len(names) or "client" in names:
            raise ValueError(f"stage names must be unique and not 'client': {names}")
        return stages


def validate_pipelines(pipelines: list[PipelineSettings]) -> None:
    """Names unique; documents folders exist.  (That no served model has a pipeline's
    name is checked when the engine is loaded.)"""
    seen: set[str] = set()
    for index, pipeline in enumerate(pipelines):
        where = f"pipelines[{index}] ({pipeline.name})"
        if pipeline.name in seen:
            raise ValueError(f"{where}: the name is already taken")
        seen.add(pipeline.name)
        if pipeline.retrieve is not None and not pipeline.retrieve.documents.is_dir():
            raise ValueError(f"{where}: documents folder {pipeline.retrieve.documents} not found")
