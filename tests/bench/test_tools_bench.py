"""``bench tools`` scores calls as a client would check them."""

from __future__ import annotations

import json

from sluicegate.bench.tools import TOOLS, check_calls


def _call(name: str, arguments: object, call_id: str = "call_1") -> dict[str, str]:
    return {"id": call_id, "name": name, "arguments": json.dumps(arguments)}


def test_a_call_that_validates_against_its_tool_passes() -> None:
    review = {"stars": 4, "summary": "Good crust.", "recommend": True}
    assert check_calls([_call("record_review", review)]) is None
    assert {tool["function"]["name"] for tool in TOOLS} >= {"record_review", "record_person"}


def test_what_a_client_could_not_use_is_named() -> None:
    assert check_calls([]) == "no tool call"
    assert "unknown tool" in (check_calls([_call("record_cat", {})]) or "")
    assert "no call id" in (check_calls([_call("record_review", {}, call_id="")]) or "")
    bad_stars = {"stars": 9, "summary": "x", "recommend": True}
    assert "9 is greater than the maximum" in (
        check_calls([_call("record_review", bad_stars)]) or ""
    )
    broken = {"id": "c", "name": "record_review", "arguments": '{"stars": 4'}
    assert "record_review" in (check_calls([broken]) or "")
