from __future__ import annotations

import pytest

from sluicegate.store.event_id import (
    format_event_id,
    parse_after_seq,
    parse_event_id,
    validate_stream_id,
)


def test_event_ids_round_trip() -> None:
    assert format_event_id("chatcmpl-0f3a", 12) == "chatcmpl-0f3a:12"
    assert parse_event_id("chatcmpl-0f3a:12") == ("chatcmpl-0f3a", 12)
    assert parse_event_id("  cmpl-1:0 ") == ("cmpl-1", 0)


@pytest.mark.parametrize(
    "bad", ["", "12", "abc", "abc:", ":3", "abc:-1", "abc:1.5", "a:٣", "a b:1", "abc:" + "9" * 19]
)
def test_malformed_last_event_ids_are_refused_with_the_expected_shape(bad: str) -> None:
    with pytest.raises(ValueError, match="stream"):
        parse_event_id(bad)


def test_after_must_be_a_non_negative_integer() -> None:
    assert parse_after_seq("7") == 7
    for bad in ("-1", "x", "", "1e3"):
        with pytest.raises(ValueError, match="after must be"):
            parse_after_seq(bad)


def test_stream_ids_are_safe_for_sse_urls_and_redis_keys() -> None:
    assert validate_stream_id("chatcmpl-abc_1.2") == "chatcmpl-abc_1.2"
    for bad in ("a{b}", "a:b", "a/b", "a\nb", "é"):
        with pytest.raises(ValueError, match=r"\[A-Za-z0-9_.-\]"):
            validate_stream_id(bad)
