"""What counts as the first meaningful token (TTFMT)."""

from __future__ import annotations

import pytest

from sluicegate.service.records import meaningful


@pytest.mark.parametrize("text", ["", " ", "\n\n", "```", "```\n", "**", "# ", "- ", "<", "."])
def test_whitespace_markup_and_punctuation_are_not(text: str) -> None:
    assert not meaningful(text)


@pytest.mark.parametrize("text", ["Hello", " 2", "```python", "é", "日本", "**Note"])
def test_a_letter_or_a_digit_is(text: str) -> None:
    assert meaningful(text)
