"""engine/deliveries.py with tools: token events become tool-call deltas, the finish
reason says ``tool_calls``, and a request resumed from any delivered point continues the
calls its client already has."""

from __future__ import annotations

from typing import Any

from sluicegate.engine.deliveries import Deliveries
from sluicegate.engine.output import RequestOutput, RequestStream, merge_tool_call
from sluicegate.engine.tokenizer import byte_level_tokenizer
from sluicegate.scheduler.request import FinishReason, Request, SamplingParams
from sluicegate.scheduler.state import TokenEvent
from sluicegate.tools.syntax import GENERIC, call_text

TOKENIZER = byte_level_tokenizer()
EOS = TOKENIZER.eos_token_ids[0]
PROMPT = [104, 105]
ANSWER = (
    call_text("get_weather", '{"city": "Zürich 水門", "unit": "celsius"}')
    + "\n"
    + call_text("add", '{"a": 2, "b": 0.5}')
)
SAMPLING = SamplingParams(max_tokens=1000, seed=11, tool_format=GENERIC)


def run(tokens: list[int], delivered: list[int]) -> list[RequestOutput]:
    """The outputs of ``tokens`` for a request that arrives with ``delivered`` output
    tokens already (a resumed one), ending with end-of-sequence."""
    request = Request("r", list(PROMPT), SAMPLING, all_token_ids=[*PROMPT, *delivered])
    deliveries = Deliveries(TOKENIZER)
    deliveries.add(request, RequestStream("r"))
    outputs = []
    for i, token in enumerate(tokens):
        request.all_token_ids.append(token)
        last = i == len(tokens) - 1
        if last:
            request.finish_reason = FinishReason.STOP
        event = TokenEvent(request, token, last, token == EOS, request.num_output_tokens)
        outputs += [out for _, out in deliveries.assemble([event], lambda r: None)]
    return outputs


def calls_of(outputs: list[RequestOutput]) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    for output in outputs:
        for fragment in output.tool_calls:
            merge_tool_call(calls, fragment)
    return calls


def test_tool_calls_and_their_finish() -> None:
    tokens = [*ANSWER.encode(), EOS]
    outputs = run(tokens, [])
    calls = calls_of(outputs)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich 水門", "unit": "celsius"}'
    assert "".join(o.text for o in outputs) == ""
    assert outputs[-1].finish_reason == FinishReason.TOOL_CALLS


def test_a_call_cut_short_is_not_tool_calls() -> None:
    outputs = run([*ANSWER.encode()[:40], EOS], [])
    assert outputs[-1].finish_reason == FinishReason.STOP


def test_resumed_from_any_delivered_point() -> None:
    tokens = [*ANSWER.encode(), EOS]
    outputs = run(tokens, [])
    whole = calls_of(outputs)
    for k in range(len(outputs)):
        # What a client has after k outputs: their calls, and the tokens they commit.
        delivered = [t for o in outputs[:k] for t in o.committed_token_ids]
        resumed = run(tokens[len(delivered) :], delivered)
        assert calls_of(outputs[:k] + resumed) == whole, k
        assert resumed[-1].finish_reason == FinishReason.TOOL_CALLS


def test_a_repeated_call_ends_the_answer_before_it() -> None:
    first = call_text("get_weather", '{"city": "Paris"}')
    tokens = [*(first + "\n" + first + "\n" + first).encode(), EOS]
    request = Request("r", list(PROMPT), SAMPLING)
    deliveries = Deliveries(TOKENIZER)
    deliveries.add(request, RequestStream("r"))
    stopped: list[Request] = []
    outputs: list[RequestOutput] = []
    for token in tokens:
        request.all_token_ids.append(token)
        event = TokenEvent(request, token, False, token == EOS, request.num_output_tokens)
        outputs += [out for _, out in deliveries.assemble([event], stopped.append)]
        if stopped:
            break
    assert stopped == [request]
    assert [c["function"]["name"] for c in calls_of(outputs)] == ["get_weather"]
    assert outputs[-1].finish_reason == FinishReason.TOOL_CALLS
    # It ended as the repeat completed: the third call was never generated.
    assert request.num_output_tokens == len((first + "\n" + first).encode())
