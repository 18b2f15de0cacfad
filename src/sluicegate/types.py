"""Primitives shared by every stage: a clock, the priority classes, JSON values."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeAlias

#: A monotonic clock in seconds (``time.monotonic`` in production, a fake in tests).
Clock = Callable[[], float]

#: What JSON can hold (stream metadata, stored formats).
JSONValue: TypeAlias = "str | int | float | bool | list[JSONValue] | dict[str, JSONValue] | None"


class PriorityClass(enum.StrEnum):
    """The two admission classes.  ``rank`` is the scheduler priority (lower runs first)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return 0 if self is PriorityClass.INTERACTIVE else 1
