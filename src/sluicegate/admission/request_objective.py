"""A client's own objective for one request, stated in headers.

* ``x-sluicegate-ttft-slo-ms``: its time-to-first-token objective, tighter or looser than
  its class's, within its tenant's ``ttft_slo_ms_range`` (default: from 50 ms to 10x the
  class's objective).  Admission predicts against it, and enforces it whatever the class
  (a batch request that states one is refused at once when it would miss it).
* ``x-sluicegate-deadline``: an absolute time by which the whole answer must be done
  (RFC 3339, or seconds since the epoch), for batch work: admission refuses at once a
  request predicted to finish after it (with admission by objective), and a request still
  queued when it passes is refused then (either admission mode).  At most a day ahead.

A value that is not a number or a time, or out of range, is a 400 naming the header.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sluicegate.admission.tenants import Tenant
from sluicegate.errors import APIError

TTFT_HEADER = "x-sluicegate-ttft-slo-ms"
DEADLINE_HEADER = "x-sluicegate-deadline"
#: Without a tenant range: the lowest objective, and the highest as a multiple of the
#: class's.
DEFAULT_MIN_TTFT_MS = 50.0
DEFAULT_MAX_TTFT_MULTIPLE = 10.0
#: The farthest deadline taken, in seconds from now.
MAX_DEADLINE_AHEAD_SECONDS = 86_400.0


@dataclass(slots=True, frozen=True)
class RequestObjective:
    """What a request stated for itself (None: nothing)."""

    ttft_seconds: float | None = None
    #: When its answer must be done, on the ``time.monotonic`` clock.
    deadline: float | None = None

    def ttft_or(self, class_seconds: float) -> float:
        """Its own TTFT objective, else its class's."""
        return class_seconds if self.ttft_seconds is None else self.ttft_seconds


def request_objective(
    headers: Mapping[str, str],
    tenant: Tenant,
    class_ttft_seconds: float | None,
    *,
    wall_clock: Callable[[], float] = time.time,
    clock: Callable[[], float] = time.monotonic,
) -> RequestObjective:
    """The objective ``headers`` state, checked against ``tenant``'s range (see the module
    docstring); raises the 400 that names a bad header."""
    ttft_value = headers.get(TTFT_HEADER)
    deadline_value = headers.get(DEADLINE_HEADER)
    ttft = None if ttft_value is None else _ttft(ttft_value, tenant, class_ttft_seconds)
    deadline = None
    if deadline_value is not None:
        at = _epoch_seconds(deadline_value)
        ahead = at - wall_clock()
        if ahead > MAX_DEADLINE_AHEAD_SECONDS:
            raise _bad(DEADLINE_HEADER, f"is more than {MAX_DEADLINE_AHEAD_SECONDS:g}s ahead")
        deadline = clock() + ahead
    return RequestObjective(ttft, deadline)


def _ttft(value: str, tenant: Tenant, class_ttft_seconds: float | None) -> float:
    try:
        ms = float(value)
    except ValueError:
        raise _bad(TTFT_HEADER, f"must be a number of milliseconds; got {value!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise _bad(TTFT_HEADER, f"must be a positive number of milliseconds; got {value!r}")
    if tenant.ttft_slo_ms_range is not None:
        low, high = tenant.ttft_slo_ms_range
    else:
        low = DEFAULT_MIN_TTFT_MS
        high = (
            math.inf
            if class_ttft_seconds is None
            else max(low, DEFAULT_MAX_TTFT_MULTIPLE * class_ttft_seconds * 1000.0)
        )
    if not low <= ms <= high:
        raise _bad(
            TTFT_HEADER, f"must be within [{low:g}, {high:g}] ms for this tenant; got {ms:g}"
        )
    return ms / 1000.0


def _epoch_seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _bad(
            DEADLINE_HEADER, f"must be an RFC 3339 time or seconds since the epoch; got {value!r}"
        ) from None
    if parsed.tzinfo is None:
        raise _bad(DEADLINE_HEADER, f"must name its time zone (Z or +hh:mm); got {value!r}")
    return parsed.timestamp()


def _bad(header: str, what: str) -> APIError:
    return APIError(400, f"The header {header} {what}.", param=header)
