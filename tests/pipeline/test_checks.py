"""Guard checks, retrieval and pipeline settings (no server; the real embedding table)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from sluicegate.pipeline.checks import SemanticCheck, build_check
from sluicegate.pipeline.retrieve import Retriever, split_passages
from sluicegate.pipeline_settings import CheckSettings, PipelineSettings, RetrieveSettings

WEAPONS = {"weapons": ["how to build a bomb or an explosive device", "guns, rifles and firearms"]}


def test_the_semantic_check_tells_a_banned_topic_from_ordinary_text() -> None:
    check = SemanticCheck("topics", WEAPONS, threshold=0.5)
    banned = [
        "Here is how you can make an explosive device using household chemicals such as",
        "The rifle and the pistol are both firearms that need a license to carry",
    ]
    clean = [
        "To bake bread, mix flour, water, yeast and salt, then knead the dough for",
        "Paris is the capital of France and is known for the Eiffel Tower and",
        "Python is a programming language that is used for data science and",
    ]
    assert all(asyncio.run(check.check(t)) is not None for t in banned)
    assert all(asyncio.run(check.check(t)) is None for t in clean)
    trip = asyncio.run(check.check(banned[0]))
    assert trip is not None and "weapons" in trip.reason


def test_the_built_in_checks_run_off_the_event_loop() -> None:
    """Every check runs on the checks' threads, the built-in ones too: the loop's answer
    time depends on no check's cost."""
    regex = build_check(CheckSettings(type="regex", patterns=["bomb"]))
    semantic = SemanticCheck("topics", WEAPONS, threshold=0.5)
    threads: list[str] = []
    for check, method in ((regex, "search"), (semantic, "judge")):
        work = getattr(check, method)

        def recorded(text: str, work: object = work) -> object:
            threads.append(threading.current_thread().name)
            return work(text)  # type: ignore[operator]

        setattr(check, method, recorded)
        assert asyncio.run(check.check("how to build a bomb")) is not None
    assert len(threads) == 2
    assert all(name.startswith("sluicegate-guard") for name in threads), threads


def test_a_check_of_your_own_is_loaded_from_its_class(tmp_path: Path) -> None:
    custom = build_check(
        CheckSettings(
            type="tests.pipeline.stall_check:StallCheck", options={"path": str(tmp_path / "absent")}
        )
    )
    assert asyncio.run(custom.check("anything")) is None
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_check(CheckSettings(type="tests.pipeline.nowhere:Nothing"))


@pytest.mark.parametrize(
    ("check", "error"),
    [
        ({"type": "regex"}, "needs patterns"),
        ({"type": "regex", "patterns": ["("]}, "missing \\)"),
        ({"type": "semantic", "topics": {"x": []}}, "example phrases"),
        ({"type": "moderation"}, "package.module:Class"),
        # A match of any length cannot be held back whole: the bound must be declared.
        ({"type": "regex", "patterns": ["ok", "(a+)+$"]}, "max_match_chars"),
        # RE2 runs in linear time, and so cannot run backreferences or lookaround.
        ({"type": "regex", "patterns": [r"(a)\1"]}, "RE2"),
        ({"type": "regex", "patterns": ["(?<=a)b"]}, "RE2"),
    ],
)
def test_bad_checks_are_refused_at_start_up(check: dict[str, object], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        CheckSettings.model_validate(check)


def test_a_check_s_longest_match_is_its_patterns_or_its_declared_bound() -> None:
    bounded = build_check(CheckSettings(type="regex", patterns=["(?i)pipe bombs?", "x{3}"]))
    assert bounded.max_match_chars == 10
    declared = CheckSettings(type="regex", patterns=[r"secret\w*"], max_match_chars=40)
    assert build_check(declared).max_match_chars == 40


def test_a_pipeline_s_stages_are_named_once_and_its_stride_fits_its_window() -> None:
    guard = {"guard": {"checks": [{"type": "regex", "patterns": ["x"]}]}}
    with pytest.raises(ValidationError, match="unique"):
        PipelineSettings.model_validate({"name": "p", "stages": [guard, guard]})
    with pytest.raises(ValidationError, match="stride_tokens"):
        PipelineSettings.model_validate(
            {
                "name": "p",
                "stages": [{"guard": {**guard["guard"], "window_tokens": 4, "stride_tokens": 8}}],
            }
        )


def test_passages_keep_paragraphs_whole_when_they_fit() -> None:
    passages = split_passages("a", "one two three\n\nfour five\n\n" + " ".join("x" * 12), 5)
    assert [p.text for p in passages][:1] == ["one two three four five"]
    assert all(len(p.text.split()) <= 5 for p in passages)


def test_retrieval_finds_the_document_that_answers(tmp_path: Path) -> None:
    (tmp_path / "refunds.md").write_text("Items can be returned within 30 days for a refund.\n")
    (tmp_path / "shipping.txt").write_text("Parcels are shipped in 3 to 5 business days.\n")
    (tmp_path / "notes.bin").write_text("refund refund refund")  # not a document
    retriever = Retriever(RetrieveSettings(documents=tmp_path, top_k=1))
    found = retriever.retrieve("How do I get a refund?")
    assert found.sources == ["refunds.md"]
    message = retriever.context_message(found)
    assert message is not None and "30 days" in message
    assert retriever.retrieve("zebra").passages == []
    assert retriever.context_message(retriever.retrieve("zebra")) is None


def test_a_catastrophic_pattern_runs_in_linear_time() -> None:
    """``^(a+)+$`` on 29 a's and a "!" took Python's re 18 s (doubling with each a), on
    the event loop; on RE2 this 100,000-character window is one pass.  (Were it Python's
    re again, this test would hang until the suite's timeout.)"""
    settings = CheckSettings(type="regex", patterns=["^(a+)+$"], max_match_chars=64)
    check = build_check(settings)
    assert asyncio.run(check.check("a" * 100_000 + "!")) is None
    assert asyncio.run(check.check("a" * 40)) is not None
