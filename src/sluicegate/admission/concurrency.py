"""Concurrency caps: in-flight counters whose only way down is an idempotent slot.

The counter cannot go negative or leak through double release: :meth:`try_acquire`
returns a :class:`ConcurrencySlot`, and only that slot can give the unit back, once.
Use it as a context manager or release it in a ``finally``.

Not thread-safe: the event loop owns it.
"""

from __future__ import annotations

from types import TracebackType


class ConcurrencyLimiter:
    """At most ``limit`` holders at once (``None``: unlimited, still counted)."""

    __slots__ = ("_in_flight", "limit", "name")

    def __init__(self, limit: int | None, name: str = "") -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"concurrency limit must be >= 0 or None; got {limit}")
        self.limit = limit
        self.name = name
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def available(self) -> int | None:
        """Free units now, or ``None`` when unlimited."""
        return None if self.limit is None else max(0, self.limit - self._in_flight)

    def has_room(self) -> bool:
        return self.limit is None or self._in_flight < self.limit

    def try_acquire(self) -> ConcurrencySlot | None:
        """A slot if below the limit, else ``None`` (nothing taken)."""
        if self.limit is not None and self._in_flight >= self.limit:
            return None
        self._in_flight += 1
        return ConcurrencySlot(self)

    def _give_back(self) -> None:
        # Slots release at most once each, so this cannot underflow; the guard is a belt
        # for the braces should that invariant ever be broken.
        if self._in_flight > 0:
            self._in_flight -= 1


class ConcurrencySlot:
    """One held unit of a :class:`ConcurrencyLimiter`.  Releasing twice is a no-op."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter: ConcurrencyLimiter | None = limiter

    @property
    def released(self) -> bool:
        return self._limiter is None

    def release(self) -> bool:
        """Give the unit back; ``True`` the first time, ``False`` after."""
        limiter = self._limiter
        if limiter is None:
            return False
        self._limiter = None
        limiter._give_back()
        return True

    def __enter__(self) -> ConcurrencySlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
