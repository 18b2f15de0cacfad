"""Guard checks: each looks at one window of text and says whether it trips.

Built in: ``regex`` (any pattern matches, on RE2: linear time) and ``semantic`` (the
window's embedding is as close as ``threshold`` to an example phrase of a banned topic;
the model is :mod:`sluicegate.pipeline.embedding`).  A check of your own is a class named in the
config as ``package.module:Class``, built with the check's ``options``, with an
``async def check(self, text: str) -> str | None`` (the reason when it trips).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

from sluicegate.pipeline_settings import CheckSettings, compile_linear, longest_match


@dataclass(slots=True, frozen=True)
class Trip:
    """Why a window tripped: the check's label and what it found."""

    check: str
    reason: str


class Check(Protocol):
    label: str
    #: The longest match it must catch whole (None: it judges windows, as the semantic
    #: check does, and no text need be held back for it).
    max_match_chars: int | None

    async def check(self, text: str) -> Trip | None: ...


class RegexCheck:
    def __init__(self, label: str, patterns: list[str], max_match_chars: int | None = None) -> None:
        self.label = label
        # RE2: matching is linear in the text, whatever the pattern.
        self.patterns = [compile_linear(p) for p in patterns]
        # Each pattern's own bound, else the declared one (settings refuse neither).
        widths = [longest_match(p) or max_match_chars or 1 for p in patterns]
        self.max_match_chars: int | None = max(widths)

    async def check(self, text: str) -> Trip | None:
        for pattern in self.patterns:
            if (match := pattern.search(text)) is not None:
                return Trip(self.label, f"matched {pattern.pattern!r}: {match.group(0)!r}")
        return None


class SemanticCheck:
    """Banned topics by similarity of static embeddings (microseconds per window)."""

    def __init__(self, label: str, topics: dict[str, list[str]], threshold: float) -> None:
        # Imported here: numpy and the table load only for a server with a semantic check.
        from sluicegate.pipeline.embedding import default_embedding

        self.label = label
        self.max_match_chars: int | None = None
        self.threshold = threshold
        self.model = default_embedding()
        self.topic_of = [topic for topic, phrases in topics.items() for _ in phrases]
        self.phrases = self.model.embed([p for phrases in topics.values() for p in phrases])

    def similarity(self, text: str) -> tuple[float, str]:
        """The closest banned topic and how close it is."""
        scores = self.phrases @ self.model.embed([text])[0]
        best = int(scores.argmax())
        return float(scores[best]), self.topic_of[best]

    async def check(self, text: str) -> Trip | None:
        score, topic = self.similarity(text)
        if score >= self.threshold:
            return Trip(self.label, f"topic {topic!r} (similarity {score:.2f})")
        return None


class _Custom:
    """A user's check class, adapted: sync or async ``check``, str or Trip result."""

    def __init__(self, label: str, target: Any) -> None:
        self.label = label
        self.target = target
        declared = getattr(target, "max_match_chars", None)
        self.max_match_chars: int | None = declared if isinstance(declared, int) else None

    async def check(self, text: str) -> Trip | None:
        result = self.target.check(text)
        if inspect.isawaitable(result):
            result = await result
        if result is None or result is False:
            return None
        if isinstance(result, Trip):
            return result
        return Trip(self.label, str(result))


def build_check(settings: CheckSettings) -> Check:
    """A check from its settings; a bad custom class is a ValueError naming it."""
    label = settings.label
    if settings.type == "regex":
        return RegexCheck(label, settings.patterns, settings.max_match_chars)
    if settings.type == "semantic":
        return SemanticCheck(label, settings.topics, settings.threshold)
    module_name, _, class_name = settings.type.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"check {settings.type!r} cannot be loaded: {error}") from None
    target = cls(**settings.options)
    if not callable(getattr(target, "check", None)):
        raise ValueError(f"check {settings.type!r} has no check(text) method")
    return _Custom(label, target)


async def first_trip(checks: list[Check], text: str) -> Trip | None:
    for check in checks:
        trip = await check.check(text)
        if trip is not None:
            return trip
    return None
