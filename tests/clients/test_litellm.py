"""litellm, unmodified, routing ``openai/<model>`` to the real server with ``tools=``:
litellm rebuilds OpenAI's response in its own types, streamed chunks included, and
``stream_chunk_builder`` joins streamed tool-call fragments the way its users do.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import openai
import pytest

from tests.clients.tools import ASK_WEATHER, SIM_MODEL, TOOLS, check_call, tool_result_turn
from tests.support.servers import ServerProcess

MODEL = f"openai/{SIM_MODEL}"

pytestmark = [
    pytest.mark.slow,
    # pydantic's, about a litellm type, on every streamed chunk whatever the server.
    pytest.mark.filterwarnings(
        "ignore:Item '.*' on TypedDict class .* is using the `ReadOnly` qualifier:UserWarning"
    ),
]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """This thread's event loop while the module runs, and closed after it: litellm's
    blocking calls dispatch their success hooks on the thread's loop and make one when
    there is none, which nobody closes (the garbage collector then fails a later test
    with a ResourceWarning)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture(scope="module")
def litellm(loop: asyncio.AbstractEventLoop) -> Iterator[ModuleType]:
    """litellm, imported by the first test that asks for it (its import takes seconds,
    which every collection of the suite would otherwise pay); afterwards, the clients it
    cached with their open connections are closed, as its exit handler would."""
    module = importlib.import_module("litellm")
    yield module
    cache = module.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        if isinstance(client, openai.OpenAI):
            client.close()
        elif isinstance(client, openai.AsyncOpenAI):
            loop.run_until_complete(client.close())
    cache.flush_cache()


def calls_of(message: Any) -> list[dict[str, Any]]:
    calls = []
    for call in message.tool_calls or []:
        assert call.id and call.type == "function"
        check_call(call.function.name, call.function.arguments)
        calls.append(
            {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        )
    return calls


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_completion_with_tools(litellm: ModuleType, sim: ServerProcess, tool_choice: str) -> None:
    response = litellm.completion(
        model=MODEL,
        api_base=sim.v1,
        api_key="unused",
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice=tool_choice,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = calls_of(choice.message)
    assert calls

    answer = litellm.completion(
        model=MODEL,
        api_base=sim.v1,
        api_key="unused",
        messages=tool_result_turn(ASK_WEATHER, calls),
        tools=TOOLS,
    )
    assert not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_rebuilt_by_stream_chunk_builder(
    litellm: ModuleType, sim: ServerProcess
) -> None:
    chunks = list(
        litellm.completion(
            model=MODEL,
            api_base=sim.v1,
            api_key="unused",
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice="required",
            stream=True,
        )
    )
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK_WEATHER)
    assert rebuilt is not None
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert calls_of(rebuilt.choices[0].message)


def test_acompletion_with_a_named_tool(
    litellm: ModuleType, loop: asyncio.AbstractEventLoop, sim: ServerProcess
) -> None:
    # On the module's loop, where the client litellm caches for it is closed afterwards.
    response = loop.run_until_complete(
        litellm.acompletion(
            model=MODEL,
            api_base=sim.v1,
            api_key="unused",
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
    )
    calls = calls_of(response.choices[0].message)
    assert calls and {call["name"] for call in calls} == {"get_time"}
