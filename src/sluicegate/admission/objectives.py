"""Latency objectives: one class's, and the automatic interactive TTFT objective
(``ttft_slo_ms: auto``) from the engine's measured prefill."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sluicegate.scheduler.seat_limit import ServiceEstimate


@dataclass(slots=True, frozen=True)
class Objectives:
    """One class's latency objectives."""

    ttft_seconds: float
    tpot_seconds: float


#: The automatic interactive TTFT objective (``ttft_slo_ms: auto``): this multiple of the
#: time to first token of a prompt of this many tokens on the idle engine, as the warm-up
#: calibrated it; never below the floor.  Twice an unloaded answer's wait is what a user
#: notices as "slower than usual"; a stricter or looser objective is a setting.
AUTO_TTFT_PROMPT_TOKENS = 256
AUTO_TTFT_MULTIPLE = 2.0
AUTO_TTFT_FLOOR_SECONDS = 0.25


def auto_ttft_seconds(estimate: ServiceEstimate) -> float:
    """The automatic TTFT objective for the engine ``estimate`` describes (10 ms steps)."""
    idle = replace(estimate, seat_limit=1)  # nothing else decoding beside the prompt
    seconds = AUTO_TTFT_MULTIPLE * idle.prefill_seconds(AUTO_TTFT_PROMPT_TOKENS)
    return max(AUTO_TTFT_FLOOR_SECONDS, math.ceil(seconds * 100.0) / 100.0)
