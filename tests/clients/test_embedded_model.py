"""The clients against the embedded model (SmolLM2, ``--engine torch``): a 135M model
left to itself rarely writes a well-formed call, so what these tests check is the
server's promise that under ``required`` or a named tool the call is always well-formed
and fits its schema (constrained decoding), whatever the model would have written.

The server is the session's (:mod:`tests.support.model_server`); a test asks the
answers it compares two at a time, and tool calls otherwise one at a time (see there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.clients.tools import (
    ASK_WEATHER,
    TOOLS,
    Person,
    Weather,
    assemble_streamed_calls,
    check_call,
)
from tests.support.inprocess import InProcessApp, serve_in_process
from tests.support.model_server import MODEL, TEST_TIMEOUT_SECONDS
from tests.support.servers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(TEST_TIMEOUT_SECONDS)]


@pytest.fixture(scope="module")
def client(model_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=model_server.v1, api_key="unused") as client:
        yield client


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_fit_their_schemas(client: openai.OpenAI, seed: int) -> None:
    # One at a time: alone, an answer's calls are drafted from its prompt (speculative
    # decoding, on while at most two sequences decode), several tokens a step; three at
    # once cost more than three one after another.
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.8,
        seed=seed,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id and call.type == "function"
        check_call(call.function.name, call.function.arguments)


def test_streamed_required_call_fits_its_schema(client: openai.OpenAI) -> None:
    deltas = []
    finishes = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    ):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes in (["tool_calls"], ["stop"])
    calls = assemble_streamed_calls(deltas)
    assert calls and sorted(calls) == list(range(len(calls)))
    for call in calls.values():
        assert call["name"] == "get_weather"
        check_call("get_weather", call["arguments"])


def test_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
    )
    calls = reply.choices[0].message.tool_calls or []
    assert calls and all(isinstance(c.function.parsed_arguments, Weather) for c in calls)


def test_langchain_structured_output_by_function_calling(model_server: ServerProcess) -> None:
    from langchain_openai import ChatOpenAI  # seconds to import: only where it is used

    llm = ChatOpenAI(model=MODEL, base_url=model_server.v1, api_key="unused")
    structured = llm.with_structured_output(Person, method="function_calling")
    texts = ("Ada is 36 and speaks English and French.", "Linus, 28, speaks Finnish.")
    # LangChain's batch: both at once, on its threads.
    people = structured.batch([f"Extract the person: {text}" for text in texts])
    assert len(people) == 2
    for person in people:
        assert isinstance(person, Person)
        assert 0 <= person.age <= 150 and len(person.languages) <= 3


@pytest.fixture
async def gateway(model_server: ServerProcess) -> AsyncIterator[InProcessApp]:
    """A gateway (``--engine upstream``) in front of the embedded model, in process: what
    is tested is what it relays, not its sockets (the gateway's are tested on the sim)."""
    async with serve_in_process(
        "--admission", "static", engine="upstream", upstream=[model_server.base_url]
    ) as app:
        yield app


#: A seeded tool-calling request that samples (so that the seed matters).
SEEDED_CALLS = {
    "model": MODEL,
    "messages": ASK_WEATHER,
    "tools": TOOLS,
    "tool_choice": "required",
    "temperature": 0.8,
    "seed": 11,
    "max_tokens": 300,
}


def _sse(response: httpx.Response) -> list[str]:
    return [line for line in response.text.splitlines() if line.startswith(("id:", "data:"))]


def _streamed_calls(lines: list[str]) -> tuple[dict[int, dict[str, str]], list[str]]:
    deltas: list[Any] = []
    finishes: list[str] = []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for choice in orjson.loads(line[6:]).get("choices", []):
            deltas += choice["delta"].get("tool_calls") or []
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    calls = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += delta.get("id") or ""
        call["name"] += (delta.get("function") or {}).get("name") or ""
        call["arguments"] += (delta.get("function") or {}).get("arguments") or ""
    return calls, finishes


async def test_tool_calls_through_a_gateway_are_the_direct_answer(
    model_server: ServerProcess, gateway: InProcessApp
) -> None:
    """Through a gateway, a seeded tool-calling answer is the answer given directly: the
    same message (calls, ids, arguments, byte for byte), streamed or not; streamed, the
    gateway sends each call whole once complete (so that a failover can restart without
    a broken call), so its chunks are fewer, and they assemble to the same calls.  (That
    the server's own stream assembles to its whole answer: tests/tools/test_model.py.)"""
    async with httpx.AsyncClient(timeout=300) as http:
        # Both at once (seeded sampling is batch-invariant): a step of two sequences costs
        # about what one of one does, and two still draft their calls (speculative
        # decoding); three at once would not.
        direct, through = await asyncio.gather(
            http.post(f"{model_server.v1}/chat/completions", json=SEEDED_CALLS),
            gateway.client.post("/v1/chat/completions", json=SEEDED_CALLS),
        )
    assert direct.status_code == through.status_code == 200, (direct.text, through.text)
    message = direct.json()["choices"][0]["message"]
    assert message["tool_calls"], message
    assert through.json()["choices"][0]["message"] == message
    assert through.json()["choices"][0]["finish_reason"] == "tool_calls"

    response = await gateway.client.post(
        "/v1/chat/completions", json={**SEEDED_CALLS, "stream": True}
    )
    through_lines = _sse(response)
    whole = {
        i: {
            "id": c["id"],
            "name": c["function"]["name"],
            "arguments": c["function"]["arguments"],
        }
        for i, c in enumerate(message["tool_calls"])
    }
    assert _streamed_calls(through_lines) == (whole, ["tool_calls"])

    # Resumed from the gateway's replay log after each event: the events after it,
    # byte for byte, tool-call deltas included.
    stream_id = response.headers["x-request-id"]
    token = {"x-sluicegate-resume-token": response.headers["x-sluicegate-resume-token"]}
    ids = [line for line in through_lines if line.startswith("id:")]
    for position, id_line in enumerate(ids):
        seq = id_line.rsplit(":", 1)[1]
        replay = await gateway.client.get(f"/v1/streams/{stream_id}?after={seq}", headers=token)
        assert replay.status_code == 200, replay.text
        after = through_lines[through_lines.index(id_line) + 1 :]
        # The last event carries the [DONE] line with it: after it, nothing.
        expected = after if position < len(ids) - 1 else []
        assert _sse(replay) == expected, position
    assert len(ids) >= 3 and through_lines[-1] == "data: [DONE]"


# --- the Responses API on the embedded model ---

#: The tools in the Responses API's flat shape.
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_responses_calls_tools_and_follows_a_schema(client: openai.OpenAI) -> None:
    # Both at once: a step of two sequences costs about what a step of one does.
    with ThreadPoolExecutor(1) as pool:
        calling = pool.submit(
            client.responses.create,
            model=MODEL,
            instructions="You answer with the tools you are given.",
            input="What is the weather in Paris, in celsius?",
            tools=RESPONSE_TOOLS,
            tool_choice="required",
            extra_body={"seed": 3},
        )
        weather = client.responses.create(
            model=MODEL,
            input="The weather to look up: Paris, in celsius. Answer in JSON.",
            text={
                "format": {
                    "type": "json_schema",
                    "name": "weather",
                    "schema": Weather.model_json_schema(),
                    "strict": True,
                }
            },
            max_output_tokens=200,
            extra_body={"seed": 3},
        )
    called = calling.result()
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed"
    for call in calls:
        check_call(call.name, call.arguments)
    assert weather.status == "completed"
    Weather.model_validate_json(weather.output_text)


def test_a_continued_conversation_reuses_its_cached_prefix(client: openai.OpenAI) -> None:
    """``previous_response_id``: the earlier turn and its answer come from the prefix
    cache.  In open mode, a stored response is its creator's: it presents the resume
    token it received (as for streams)."""
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input="My favourite colour is blue. Remember it. " * 6,
        max_output_tokens=16,
        extra_body={"seed": 1},
    )
    first = raw.parse()
    token = {"x-sluicegate-resume-token": raw.headers["x-sluicegate-resume-token"]}
    second = client.responses.create(
        model=MODEL,
        input="What is my favourite colour?",
        previous_response_id=first.id,
        max_output_tokens=16,
        extra_headers=token,
    )
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # no token: not found
    assert client.responses.retrieve(first.id, extra_headers=token).id == first.id
