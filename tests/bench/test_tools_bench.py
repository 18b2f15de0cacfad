"""``bench tools`` scores calls as a client would check them."""

from __future__ import annotations

import json

from sluicegate.bench.tools import TOOLS, check_calls, free_messages
from tests.support.inprocess import serve_in_process


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


async def test_the_free_round_sends_the_prompt_the_tool_round_becomes() -> None:
    """The comparison of time per token is fair only over the same prompt: the free
    round's messages render to exactly the tokens a tool request's do."""
    prompt = "Describe a person who lives by the sea."
    async with serve_in_process(max_num_seqs=4, max_model_len=4096) as app:
        user = [{"role": "user", "content": prompt}]
        asked = {"max_tokens": 1, "temperature": 0}
        with_tools = await app.client.post(
            "/v1/chat/completions",
            json={"messages": user, "tools": TOOLS, "tool_choice": "required", **asked},
        )
        free = await app.client.post(
            "/v1/chat/completions", json={"messages": free_messages(prompt), **asked}
        )
        bare = await app.client.post("/v1/chat/completions", json={"messages": user, **asked})
    counts = [r.json()["usage"]["prompt_tokens"] for r in (with_tools, free, bare)]
    assert counts[0] == counts[1] > 10 * counts[2]
