"""instructor, unmodified, in its default mode (``Mode.TOOLS``: the pydantic model is
offered as the one tool and forced by name), against the real server.

instructor validates the call's arguments with the model and, with its default single
attempt, raises on the first answer that does not fit: each test fails on any call the
server makes outside the schema (bounds, enums, array lengths, nesting).
"""

from __future__ import annotations

from collections.abc import Iterator

import instructor
import openai
import pytest

from tests.clients.tools import SIM_MODEL, Person, Trip, Weather
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(sim: ServerProcess) -> Iterator[instructor.Instructor]:
    with openai.OpenAI(base_url=sim.v1, api_key="unused") as raw:
        patched = instructor.from_openai(raw)
        assert patched.mode is instructor.Mode.TOOLS  # the default this file is about
        yield patched


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name", ["Ada", "Grace", "Linus", "Barbara"])
def test_response_model_is_returned_valid(client: instructor.Instructor, name: str) -> None:
    person = client.chat.completions.create(
        model=SIM_MODEL,
        response_model=Person,
        messages=ask(f"{name} is 36 and speaks English and French. Extract the person."),
    )
    assert isinstance(person, Person)
    assert 0 <= person.age <= 150 and len(person.languages) <= 3


def test_nested_models_and_the_raw_completion(client: instructor.Instructor) -> None:
    trip, completion = client.chat.completions.create_with_completion(
        model=SIM_MODEL,
        response_model=Trip,
        messages=ask("Two friends spend five nights in Lisbon. Extract the trip."),
    )
    assert isinstance(trip, Trip)
    assert all(isinstance(person, Person) for person in trip.travellers)
    message = completion.choices[0].message
    assert message.tool_calls and [c.function.name for c in message.tool_calls] == ["Trip"]
    raw = Trip.model_validate_json(message.tool_calls[0].function.arguments)
    assert raw.model_dump() == trip.model_dump()


def test_partial_objects_stream_to_the_whole(client: instructor.Instructor) -> None:
    # create_partial streams the tool call's argument fragments and parses each prefix.
    partials = list(
        client.chat.completions.create_partial(
            model=SIM_MODEL,
            response_model=Weather,
            messages=ask("What is the weather in Paris, in celsius?"),
        )
    )
    assert partials
    final = Weather.model_validate(partials[-1].model_dump())
    assert final.unit in ("celsius", "fahrenheit")


async def test_the_async_client(sim: ServerProcess) -> None:
    async with openai.AsyncOpenAI(base_url=sim.v1, api_key="unused") as raw:
        client = instructor.from_openai(raw)
        person = await client.chat.completions.create(
            model=SIM_MODEL,
            response_model=Person,
            messages=ask("Ada is 36 and speaks English. Extract the person."),
        )
    assert isinstance(person, Person)
