"""LangChain's ``ChatOpenAI``, unmodified and with its defaults, against the real server:
``bind_tools`` and an agent's second turn, function-calling structured output, and
tool calls streamed as ``tool_call_chunks``.

LangChain parses the server's calls itself: an argument text that is not JSON becomes an
``invalid_tool_calls`` entry, and structured output raises on anything the pydantic
model refuses, so these tests fail on any malformed call the server lets through.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool

from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.clients.tools import SIM_MODEL, Trip, check_arguments
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return f"18 degrees {unit} in {city}"


@tool
def get_time(timezone: str) -> str:
    """The local time in a time zone."""
    return f"09:30 in {timezone}"


LC_TOOLS = {"get_weather": get_weather, "get_time": get_time}
ASK = [HumanMessage("What is the weather in Paris, in celsius?")]


@pytest.fixture(scope="module")
def llm(sim: ServerProcess) -> ChatOpenAI:
    # Imported here: langchain_openai takes seconds to import, which every collection of
    # the suite (make test-fast too) would otherwise pay.
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=SIM_MODEL, base_url=sim.v1, api_key="unused")


def check_tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    """``message``'s parsed calls, each to an offered tool with arguments that fit it."""
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    calls = list(message.tool_calls)
    for call in calls:
        assert call["id"]
        schema = convert_to_openai_tool(LC_TOOLS[call["name"]])["function"]["parameters"]
        check_arguments(schema, json.dumps(call["args"]))
    return calls


def test_bind_tools_calls_a_tool_and_answers_its_result(llm: ChatOpenAI) -> None:
    with_tools = llm.bind_tools(list(LC_TOOLS.values()))
    reply = with_tools.invoke(ASK)
    assert isinstance(reply, AIMessage)
    calls = check_tool_calls(reply)
    assert calls
    assert reply.response_metadata["finish_reason"] == "tool_calls"

    # The agent loop: run each tool, send its result back, get the answer in text.
    history: list[BaseMessage] = [*ASK, reply]
    history += [LC_TOOLS[call["name"]].invoke(call) for call in calls]
    answer = with_tools.invoke(history)
    assert isinstance(answer, AIMessage)
    assert not answer.tool_calls and not answer.invalid_tool_calls
    assert isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["any", "get_time"])
def test_bind_tools_with_a_tool_choice(llm: ChatOpenAI, tool_choice: str) -> None:
    # "any" is LangChain's word for "required"; a tool's name forces that tool.
    reply = llm.bind_tools(list(LC_TOOLS.values()), tool_choice=tool_choice).invoke(ASK)
    assert isinstance(reply, AIMessage)
    calls = check_tool_calls(reply)
    assert calls
    if tool_choice != "any":
        assert {call["name"] for call in calls} == {tool_choice}


def test_structured_output_by_function_calling_is_the_model(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(Trip, method="function_calling")
    for city in ("Lisbon", "Oslo", "Kyoto"):
        trip = structured.invoke(f"Plan a trip to {city} for two friends.")
        assert isinstance(trip, Trip)
        assert 1 <= trip.nights <= 30 and 1 <= len(trip.travellers) <= 2


def test_structured_output_with_the_raw_message(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(Trip, method="function_calling", include_raw=True)
    result = structured.invoke("Plan a trip to Lisbon for two friends.")
    assert isinstance(result, dict)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Trip)
    raw = result["raw"]
    assert isinstance(raw, AIMessage)
    assert [call["name"] for call in raw.tool_calls] == ["Trip"]
    assert Trip.model_validate(raw.tool_calls[0]["args"]) == result["parsed"]


def test_streamed_tool_call_chunks_join_into_the_calls(llm: ChatOpenAI) -> None:
    with_tools = llm.bind_tools(list(LC_TOOLS.values()), tool_choice="any")
    joined: AIMessageChunk | None = None
    num_chunks_with_calls = 0
    for chunk in with_tools.stream(ASK):
        assert isinstance(chunk, AIMessageChunk)
        num_chunks_with_calls += bool(chunk.tool_call_chunks)
        joined = chunk if joined is None else joined + chunk
    assert joined is not None and num_chunks_with_calls >= 1
    assert joined.tool_call_chunks
    for piece in joined.tool_call_chunks:
        assert piece["name"] in LC_TOOLS and piece["id"]
    calls = check_tool_calls(joined)
    assert len(calls) == len(joined.tool_call_chunks)
    assert joined.response_metadata.get("finish_reason") == "tool_calls"


async def test_astream_then_a_second_turn(llm: ChatOpenAI) -> None:
    with_tools = llm.bind_tools(list(LC_TOOLS.values()))
    joined: AIMessageChunk | None = None
    async for chunk in with_tools.astream(ASK):
        assert isinstance(chunk, AIMessageChunk)
        joined = chunk if joined is None else joined + chunk
    assert joined is not None
    calls = check_tool_calls(joined)
    assert calls
    history: list[BaseMessage] = [*ASK, joined]
    history += [await LC_TOOLS[call["name"]].ainvoke(call) for call in calls]
    text = ""
    async for chunk in with_tools.astream(history):
        assert isinstance(chunk, AIMessageChunk)
        assert not chunk.tool_call_chunks
        text += chunk.text
    assert text


def test_openai_embeddings_rank_a_paraphrase_first(sim: ServerProcess) -> None:
    """``OpenAIEmbeddings`` against the server's embedding model.  One setting differs
    from its defaults: ``check_embedding_ctx_length=False``.  By default it tokenises
    with tiktoken (whose vocabulary it downloads: this machine has no network) and sends
    OpenAI's token ids, which another model's tokenizer cannot read (the server answers
    that with a 400 naming ``input``)."""
    import numpy as np
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(
        model=EMBEDDING_MODEL, base_url=sim.v1, api_key="unused", check_embedding_ctx_length=False
    )
    documents = ["The cat sat on the mat.", "Quarterly revenue grew by five percent."]
    vectors = np.asarray(embedder.embed_documents(documents))
    query = np.asarray(embedder.embed_query("A cat was sitting on the rug."))
    assert vectors.shape == (2, 256) and query.shape == (256,)
    scores = vectors @ query
    assert scores[0] > scores[1]
