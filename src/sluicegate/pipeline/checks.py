"""Guard checks: each looks at one window of text and says whether it trips.

Built in: ``regex`` (any pattern matches, on RE2: linear time) and ``semantic`` (the
window's embedding is as close as ``threshold`` to an example phrase of a banned topic;
the model is :mod:`sluicegate.pipeline.embedding`).  A check of your own is a class named in the
config as ``package.module:Class``, built with the check's ``options``, with a
``check(self, text: str) -> str | None`` (the reason when it trips), plain or ``async``.

Every check has a deadline (``check_timeout_seconds``) and runs off the event loop: the
built-in ones and a plain custom one on a small pool of threads (:data:`CHECK_THREADS`),
an ``async`` custom one on the loop under the deadline (it must await, not block).  The
built-in checks are bounded by construction too (RE2 is linear in the window, the
semantic check a fixed ~70 µs per window of at most 512 tokens), but the loop's answer
time (``/health``, every other stream) then depends on no check's cost at all.  A check past its
deadline *fails closed*: the window trips, with a reason that says so
(:attr:`Trip.timed_out`, counted in ``sluicegate_guard_check_timeouts_total``).  A
thread cannot be stopped: a hung custom check keeps its thread until it returns, and
with every thread taken the next custom checks wait for one, past their deadline, and
fail closed too: the pool bounds what hung checks can take, and the loop is never theirs.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from sluicegate.pipeline_settings import CheckSettings, compile_linear, longest_match


@dataclass(slots=True, frozen=True)
class Trip:
    """Why a window tripped: the check's label and what it found."""

    check: str
    reason: str
    #: The check did not answer within its deadline (failed closed).
    timed_out: bool = False


#: Threads the checks run on (shared by every pipeline of the process).
CHECK_THREADS = 4
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="sluicegate-guard")
    return _pool


async def off_loop(work: Callable[[str], Trip | None], text: str) -> Trip | None:
    """``work(text)`` on the checks' threads."""
    return await asyncio.get_running_loop().run_in_executor(_threads(), work, text)


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
        return await off_loop(self.search, text)

    def search(self, text: str) -> Trip | None:
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
        return await off_loop(self.judge, text)

    def judge(self, text: str) -> Trip | None:
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
        if inspect.iscoroutinefunction(self.target.check):
            return self._trip(await self.target.check(text))
        return await off_loop(lambda t: self._trip(self.target.check(t)), text)

    def _trip(self, result: Any) -> Trip | None:
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


#: A check's deadline when its guard sets none.
DEFAULT_CHECK_TIMEOUT_SECONDS = 1.0


async def first_trip(
    checks: list[Check], text: str, timeout_seconds: float = DEFAULT_CHECK_TIMEOUT_SECONDS
) -> Trip | None:
    """The first check that trips on ``text``; one past ``timeout_seconds`` trips (fails
    closed)."""
    for check in checks:
        try:
            async with asyncio.timeout(timeout_seconds):
                trip = await check.check(text)
        except TimeoutError:
            reason = f"no answer within {timeout_seconds:g}s: failed closed"
            return Trip(check.label, reason, timed_out=True)
        if trip is not None:
            return trip
    return None
