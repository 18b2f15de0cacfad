"""QoE per answer (after Andes, as ``sluicegate bench`` scores it): token ``i`` is on time
when written by arrival + the TTFT objective + ``i / pace``."""

from __future__ import annotations

from typing import Any, ClassVar, cast

from sluicegate.admission.objectives import Objectives
from sluicegate.engine.output import RequestStream
from sluicegate.scheduler.request import Request, SamplingParams
from sluicegate.service.generation import Generation
from sluicegate.service.ownership import Owner
from sluicegate.service.records import count_on_time
from sluicegate.types import PriorityClass


class _SLO:
    objectives: ClassVar[dict[PriorityClass, Objectives]] = {
        PriorityClass.INTERACTIVE: Objectives(ttft_seconds=1.0, tpot_seconds=0.1)
    }


def generation(priority: str = "interactive") -> Generation:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100, seed=0))
    request.arrival_time = 100.0
    return Generation("r", request, RequestStream("r"), None, Owner("t", ""), priority)


def test_tokens_written_after_a_reader_at_its_pace_needs_them_are_late() -> None:
    slo = cast(Any, _SLO())
    gen = generation()
    # 10 tokens at once, 2 s after arrival, for a reader at 5 tokens/s: token i is due
    # at 1.0 + i / 5 s, so tokens 0-4 (due by 1.8 s) are late and 5-9 on time.
    count_on_time(gen, 0, 10, 102.0, slo, reading_pace=5.0)
    assert gen.num_tokens_on_time == 5
    # The next 10, at 3 s: due from 3.0 s (token 10) on, so all on time.
    count_on_time(gen, 10, 10, 103.0, slo, reading_pace=5.0)
    assert gen.num_tokens_on_time == 15
    # A measured pace wins over the default: at 20 tokens/s token 20 is due at 2.0 s.
    gen.request.pace.measured_tokens_per_second = 20.0
    count_on_time(gen, 20, 10, 102.4, slo, reading_pace=5.0)
    assert gen.num_tokens_on_time == 15 + 2  # tokens 28 and 29 (due at 2.4, 2.45 s)


def test_only_interactive_answers_are_scored() -> None:
    gen = generation("batch")
    count_on_time(gen, 0, 10, 100.1, cast(Any, _SLO()), reading_pace=5.0)
    assert gen.num_tokens_on_time == 0
