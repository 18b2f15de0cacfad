"""The guard and format stages, delta by delta (no server)."""

from __future__ import annotations

import asyncio

from sluicegate.engine.output import RequestOutput
from sluicegate.pipeline.checks import RegexCheck, Trip
from sluicegate.pipeline.stages import FormatStage, GuardStage
from sluicegate.pipeline_settings import CheckSettings, FormatSettings, GuardSettings
from sluicegate.scheduler.request import FinishReason


def delta(text: str, n: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", text, 1, 5, n, finish, committed_token_ids=[n])


def guard(window: int, stride: int, pattern: str) -> tuple[GuardStage, list[Trip]]:
    trips: list[Trip] = []
    settings = GuardSettings(
        window_tokens=window,
        stride_tokens=stride,
        replacement="[filtered]",
        checks=[CheckSettings(type="regex", patterns=[pattern])],
    )
    return GuardStage(settings, [RegexCheck("words", [pattern])], trips.append), trips


def run(
    stage: GuardStage | FormatStage, words: list[str], last: FinishReason
) -> list[list[RequestOutput]]:
    """What the stage passes on after each delta (one token per word)."""

    async def go() -> list[list[RequestOutput]]:
        out = []
        for i, word in enumerate(words):
            finish = last if i == len(words) - 1 else None
            out.append(await stage.process(delta(word, i + 1, finish)))
        return out

    return asyncio.run(go())


WORDS = [f"w{i} " for i in range(20)]


def test_a_token_waits_at_most_a_stride_and_every_token_is_released_once() -> None:
    stage, trips = guard(8, 4, "never")
    passed = run(stage, WORDS[:10], FinishReason.LENGTH)
    # Released after every 4th token, then the rest with the end.
    assert [len(p) for p in passed] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 1]
    released = [o for p in passed for o in p]
    assert "".join(o.text for o in released) == "".join(WORDS[:10])
    assert sum(o.num_new_tokens for o in released) == 10
    assert [t for o in released for t in o.committed_token_ids] == list(range(1, 11))
    assert released[-1].finish_reason == FinishReason.LENGTH
    assert not trips and stage.windows == 3


def test_a_trip_sends_nothing_of_its_window_and_ends_with_the_replacement() -> None:
    stage, trips = guard(8, 4, "w6 ")
    passed = run(stage, WORDS[:12], FinishReason.LENGTH)
    released = [o for p in passed[:7] for o in p]
    # w0..w2 went out at the first check (w3 held back: "w6 " is 3 characters, so the
    # last 2 stay until more text comes); w3..w7 would have been the next release.
    assert "".join(o.text for o in released if o.finish_reason is None) == "w0 w1 w2 "
    final = passed[7][0]
    assert final.finish_reason == FinishReason.CONTENT_FILTER and final.text == "[filtered]"
    assert final.committed_token_ids == []
    assert [t.check for t in trips] == ["words"]
    assert all(p == [] for p in passed[8:])  # nothing after the trip


def test_a_match_across_strides_is_caught_before_any_of_it_is_sent() -> None:
    """ "w3 w4" straddles the first release: the deltas holding its first 4 characters
    (w2, w3) stay held, so the next window sees it whole and none of it went out."""
    stage, trips = guard(8, 4, "w3 w4")
    passed = run(stage, WORDS[:8], FinishReason.STOP)
    assert "".join(o.text for o in passed[3]) == "w0 w1 "
    assert passed[7][0].finish_reason == FinishReason.CONTENT_FILTER
    sent = "".join(o.text for p in passed for o in p if o.finish_reason is None)
    assert "w3" not in sent and trips


def test_a_stopped_answer_drops_what_was_not_checked() -> None:
    stage, _ = guard(8, 4, "never")
    passed = run(stage, WORDS[:6], FinishReason.ABORT)
    final = passed[-1][0]
    assert final.finish_reason == FinishReason.ABORT and final.text == ""
    assert final.committed_token_ids == []  # w4, w5 were never checked: not logged


def test_format_wraps_the_answer_and_cites_its_sources() -> None:
    settings = FormatSettings(prefix="> ", suffix=" <", citations=True)
    passed = run(
        FormatStage(settings, ["a.md", "b.md"], resumed=False), ["x", "y"], FinishReason.STOP
    )
    assert "".join(o.text for p in passed for o in p) == "> xy <\n\nSources: a.md, b.md"
    resumed = run(FormatStage(settings, [], resumed=True), ["x"], FinishReason.ABORT)
    assert resumed[0][0].text == "x"  # no second prefix after a takeover; no end on an abort
