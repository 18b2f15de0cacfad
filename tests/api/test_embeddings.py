"""``POST /v1/embeddings`` and ``GET /v1/models/{id}`` through the official client, in
process (the served app with the sim engine; the embedding model is WordLlama's table,
which ``make install`` installs)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import numpy as np
import openai
import pytest

from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support.inprocess import InProcessApp, serve_in_process

MODEL = "sluicegate-sim"


@pytest.fixture
async def app() -> AsyncIterator[InProcessApp]:
    async with serve_in_process(admission="static") as served:
        yield served


def _unit(vectors: list[list[float]]) -> np.ndarray:
    array = np.asarray(vectors, dtype=np.float32)
    assert np.allclose(np.linalg.norm(array, axis=1), 1.0, atol=1e-5)
    return array


async def test_a_paraphrase_ranks_above_an_unrelated_sentence(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    texts = [
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Quarterly revenue grew by five percent.",
    ]
    # The official client asks for base64 by default and decodes it.
    reply = await client.embeddings.create(model=EMBEDDING_MODEL, input=texts)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == EMBEDDING_MODEL
    vectors = _unit([d.embedding for d in reply.data])
    assert vectors.shape == (3, 256)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.1
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 3 * 5
    floats = await client.embeddings.create(
        model=EMBEDDING_MODEL, input=texts, encoding_format="float"
    )
    assert np.allclose(_unit([d.embedding for d in floats.data]), vectors, atol=1e-6)


async def test_dimensions_keep_the_leading_components_renormalised(app: InProcessApp) -> None:
    body = {"model": EMBEDDING_MODEL, "input": "a river in spring", "encoding_format": "float"}
    whole = (await app.client.post("/v1/embeddings", json=body)).json()["data"][0]["embedding"]
    cut = await app.client.post("/v1/embeddings", json={**body, "dimensions": 64})
    assert cut.status_code == 200, cut.text
    short = np.asarray(cut.json()["data"][0]["embedding"], dtype=np.float32)
    prefix = np.asarray(whole[:64], dtype=np.float32)
    assert short.shape == (64,)
    assert np.allclose(short, prefix / np.linalg.norm(prefix), atol=1e-5)
    raw = await app.client.post(
        "/v1/embeddings", json={**body, "encoding_format": "base64", "dimensions": 64}
    )
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    assert np.array_equal(decoded, short)


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": "x"}, "model", 400),
        ({"model": MODEL, "input": "x"}, "model", 404),
        ({"model": EMBEDDING_MODEL, "input": []}, "input", 400),
        ({"model": EMBEDDING_MODEL, "input": [""]}, "input", 400),
        ({"model": EMBEDDING_MODEL, "input": [[1, 2, 3]]}, "input", 400),
        ({"model": EMBEDDING_MODEL, "input": [1, 2, 3]}, "input", 400),
        ({"model": EMBEDDING_MODEL, "input": ["x"] * 2049}, "input", 400),
        ({"model": EMBEDDING_MODEL, "input": "x", "dimensions": 0}, "dimensions", 400),
        ({"model": EMBEDDING_MODEL, "input": "x", "dimensions": 257}, "dimensions", 400),
        (
            {"model": EMBEDDING_MODEL, "input": "x", "encoding_format": "int8"},
            "encoding_format",
            400,
        ),
        ({"model": EMBEDDING_MODEL, "input": "x", "pooling": "cls"}, "pooling", 400),
        ({"model": EMBEDDING_MODEL, "input": "word " * 9000}, "input", 400),
    ],
)
async def test_bad_requests_are_specific_errors(
    app: InProcessApp, body: dict[str, object], param: str, status: int
) -> None:
    response = await app.client.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


async def test_the_inputs_tokens_are_charged_to_the_tenant() -> None:
    # 60 tokens a minute: the first request's ~40 tokens pass, the second's must wait.
    tenants = [{"name": "t", "api_key": "k", "tokens_per_minute": 60}]
    async with serve_in_process(admission="static", tenants=tenants) as served:
        client = served.openai(api_key="k", max_retries=0)
        text = "the quick brown fox jumps over the lazy dog " * 4
        first = await client.embeddings.create(model=EMBEDDING_MODEL, input=text)
        assert 20 < first.usage.prompt_tokens <= 60
        with pytest.raises(openai.RateLimitError) as refused:
            await client.embeddings.create(model=EMBEDDING_MODEL, input=text)
        assert int(refused.value.response.headers["retry-after"]) >= 1


async def test_models_are_listed_and_retrieved_by_id(app: InProcessApp) -> None:
    client = app.openai(max_retries=0)
    listed = {m.id: m for m in (await client.models.list()).data}
    assert list(listed) == [MODEL, EMBEDDING_MODEL]  # the chat model first
    embedding = await client.models.retrieve(EMBEDDING_MODEL)
    assert embedding.id == EMBEDDING_MODEL and embedding.object == "model"
    assert embedding.model_extra == {"task": "embed", "dimensions": 256, "max_model_len": 8192}
    chat = await client.models.retrieve(MODEL)
    assert chat.id == MODEL and chat.owned_by == "sluicegate"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
