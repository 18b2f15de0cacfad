"""Prompt-lookup drafting: the n-gram index, draft lengths and back-off."""

from __future__ import annotations

import pytest

from sluicegate.scheduler.prompt_lookup import MAX_SKIP_STEPS, PromptLookup, SpeculationConfig


def test_drafts_what_followed_the_latest_earlier_occurrence() -> None:
    lookup = PromptLookup(SpeculationConfig(num_tokens=8))
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 0, 2, 3]
    # "2 3" occurred twice before the end; the latest (followed by 7 8 0) wins.
    assert lookup.propose(tokens, limit=4) == [7, 8, 0, 2]


def test_the_longest_ngram_decides() -> None:
    lookup = PromptLookup(SpeculationConfig(num_tokens=8, min_ngram=1, max_ngram=3))
    tokens = [5, 1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 1, 2, 3]
    # "1 2 3" is at the start (followed by 40); the shorter "2 3" is later (followed by 50).
    assert lookup.propose(tokens, limit=2) == [40, 41]


def test_no_match_no_draft_and_the_index_grows_with_the_tokens() -> None:
    lookup = PromptLookup(SpeculationConfig(num_tokens=8))
    tokens = [1, 2, 3, 4]
    assert lookup.propose(tokens, limit=4) == []
    tokens += [5, 1, 2]
    assert lookup.propose(tokens, limit=4) == [3, 4, 5, 1]
    assert lookup.propose(tokens, limit=0) == []


def test_a_copy_that_goes_on_keeps_to_the_same_place() -> None:
    """Where an n-gram recurs (the keys of a JSON list, say), its latest occurrence may be
    the wrong one; a copy that went on as drafted continues from where it was taken."""
    a, b = 50, 60
    prompt = [a, 1, 2, 3, 7, b, 1, 2, 3, 8]
    lookup = PromptLookup(SpeculationConfig(num_tokens=8, max_ngram=2))
    tokens = [*prompt, a, 1]  # the answer starts copying the first block
    assert lookup.propose(tokens, limit=1) == [2]
    lookup.record(1, 1)
    tokens += [2, 3]  # the draft, then the model's own next token: still the copy
    assert lookup.propose(tokens, limit=2) == [7, b]  # not [8, ...] after the later "2 3"
    lookup.record(2, 1)
    tokens += [7, 9]  # the copy ends: back to looking n-grams up
    assert lookup.propose(tokens, limit=2) == []
    fresh = PromptLookup(SpeculationConfig(num_tokens=8, max_ngram=2))
    assert fresh.propose([*prompt, a, 1, 2, 3], limit=1) == [8]


def test_failing_drafts_back_off_exponentially_and_a_hit_resets() -> None:
    lookup = PromptLookup(SpeculationConfig(num_tokens=4))
    tokens = [1, 2, 7, 1, 2]
    skips = []
    for _ in range(8):
        lookup.record(1, 0)
        skips.append(lookup.skip)
        lookup.skip = 0
    assert skips == [1, 2, 4, 8, 16, 32, MAX_SKIP_STEPS, MAX_SKIP_STEPS]
    lookup.record(1, 0)
    # Sitting out: no draft until the skipped steps have passed.
    assert [lookup.propose(tokens, 4) for _ in range(MAX_SKIP_STEPS)] == [[]] * MAX_SKIP_STEPS
    assert lookup.propose(tokens, 4) == [7, 1, 2]
    lookup.record(1, 1)
    assert lookup.misses == 0


@pytest.mark.parametrize(
    "kwargs", [{"num_tokens": -1}, {"min_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}]
)
def test_bad_config_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SpeculationConfig(**kwargs)
