"""Small shared types of the admission layer."""

from __future__ import annotations

import enum
from collections.abc import Callable

#: A monotonic clock in seconds (``time.monotonic`` in production, a fake in tests).
Clock = Callable[[], float]


class PriorityClass(enum.StrEnum):
    """The two admission classes.  ``rank`` is the scheduler priority (lower runs first)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return 0 if self is PriorityClass.INTERACTIVE else 1
