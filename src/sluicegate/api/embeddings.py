"""``POST /v1/embeddings``: WordLlama's static embedding table (the one the pipelines'
semantic guard uses, :mod:`sluicegate.pipeline.embedding`) served as an embedding model,
in OpenAI's shapes, in every engine mode.

A text's embedding is the mean of its tokens' rows, cut to ``dimensions`` (the table is
trained so that its first 64, 128 or any leading components are an embedding too) and
normalised: a tokenisation and a mean, microseconds a text, computed on a worker thread
so that a batch of 2,048 inputs never holds the event loop.  Requests pass the front
door as completions do: the tenant's key, its request bucket before the body is read,
its token bucket for the inputs' tokens.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.responses import Response

from sluicegate.admission.tenants import Tenant
from sluicegate.api.body import parse_json, read_body
from sluicegate.api.state import app_state
from sluicegate.api.stats import json_response
from sluicegate.errors import APIError, invalid_param
from sluicegate.pipeline.embedding import (
    EMBEDDING_MODEL,
    INSTALL,
    Vectors,
    default_embedding,
    embedding_available,
)
from sluicegate.service.service import Service

router = APIRouter()

#: Inputs in one request, and tokens in one input (OpenAI's limits for its own models).
MAX_INPUTS = 2048
MAX_INPUT_TOKENS = 8192
#: Dimensions of the shipped table (``l2_supercat_256``).
DIMENSIONS = 256


def embedding_model_entry(created: int) -> dict[str, object]:
    """The embedding model as ``GET /v1/models`` lists it (``task: "embed"``, as vLLM
    names the kind: a gateway in front of this server does not route chat to it)."""
    return {
        "id": EMBEDDING_MODEL,
        "object": "model",
        "created": created,
        "owned_by": "sluicegate",
        "task": "embed",
        "dimensions": DIMENSIONS,
        # What the other entries call it: the tokens one input may hold.
        "max_model_len": MAX_INPUT_TOKENS,
    }


def requested_model(body: Any, relayed: list[str]) -> str:
    """The embedding model a request names: this server's, or one of ``relayed`` (an
    upstream's); a 400 or 404 naming ``model`` otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_param("model", "'model' is required: the embedding model's name.")
    if model != EMBEDDING_MODEL and model not in relayed:
        served = ", ".join(f"'{name}'" for name in [EMBEDDING_MODEL, *relayed])
        raise APIError(
            404,
            f"The model '{model}' does not exist or is not an embedding model; "
            f"this server embeds with {served}.",
            param="model",
            code="model_not_found",
        )
    return model


def parse_request(body: dict[str, Any]) -> tuple[list[str], str, int]:
    """``(texts, encoding_format, dimensions)`` of a request to this server's model; a
    400 naming the parameter for anything else."""
    texts = _texts(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise invalid_param(
            "encoding_format", f"encoding_format must be 'float' or 'base64'; got {encoding!r}"
        )
    dimensions = body.get("dimensions", DIMENSIONS)
    if dimensions is None:
        dimensions = DIMENSIONS
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise invalid_param("dimensions", f"dimensions must be an integer; got {dimensions!r}")
    if not 1 <= dimensions <= DIMENSIONS:
        raise invalid_param(
            "dimensions", f"dimensions must be between 1 and {DIMENSIONS}; got {dimensions}"
        )
    unknown = set(body) - {"model", "input", "encoding_format", "dimensions", "user"}
    if unknown:
        name = sorted(unknown)[0]
        raise invalid_param(name, f"Unrecognized request argument supplied: {name}")
    return texts, str(encoding), dimensions


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid_param("input", "'input' must be a string or a non-empty list of strings.")
    if len(value) > MAX_INPUTS:
        raise invalid_param(
            "input", f"'input' holds {len(value)} items; at most {MAX_INPUTS} in one request."
        )
    for i, item in enumerate(value):
        if isinstance(item, int | list) and not isinstance(item, bool):
            raise invalid_param(
                "input",
                "'input' holds token ids, which this model cannot read (they are another "
                "tokenizer's): send the text. (LangChain's OpenAIEmbeddings: "
                "check_embedding_ctx_length=False.)",
            )
        if not isinstance(item, str):
            raise invalid_param("input", f"input[{i}] must be a string; got {item!r:.60}")
        if not item:
            raise invalid_param("input", f"input[{i}] is empty: an empty string has no embedding.")
    return value


def _encoded(vector: Vectors, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


@router.post("/v1/embeddings")
async def embeddings(request: HTTPRequest) -> Response:
    state = app_state(request)
    service = state.require_ready().service
    tenant = service.authenticate(request.headers.get("authorization"))
    await service.charge_request(tenant)
    raw = await read_body(request, service.settings.max_request_body_bytes)
    body = parse_json(raw)
    model_name = requested_model(body, service.embedding_models)
    if model_name != EMBEDDING_MODEL:
        return await _relayed(service, tenant, model_name, body, raw)
    texts, encoding, dimensions = parse_request(body)
    if not embedding_available():
        raise APIError(
            404,
            f"The embedding model '{EMBEDDING_MODEL}' is not installed here: `{INSTALL}`.",
            param="model",
            code="model_not_found",
        )
    model = await asyncio.to_thread(default_embedding)
    token_ids = await asyncio.to_thread(model.encode, texts)
    for i, ids in enumerate(token_ids):
        if len(ids) > MAX_INPUT_TOKENS:
            raise APIError(
                400,
                f"input[{i}] is {len(ids)} tokens; this model reads at most "
                f"{MAX_INPUT_TOKENS} a text.",
                param="input",
                code="context_length_exceeded",
            )
    tokens = sum(len(ids) for ids in token_ids)
    await service.charge_tokens(tenant, tokens, 0)
    vectors = await asyncio.to_thread(model.pool, token_ids, dimensions)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vectors[i], encoding)}
        for i in range(len(texts))
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return json_response({"object": "list", "data": data, "model": EMBEDDING_MODEL, "usage": usage})


async def _relayed(
    service: Service, tenant: Tenant, model: str, body: dict[str, Any], raw: bytes
) -> Response:
    """An upstream's embedding model: the body goes as sent, and the upstream's answer
    comes back as it was.  The tenant's token bucket is charged an estimate first (a
    token per 4 bytes of text, a token per token id), as the gateway cannot count another
    model's tokens."""
    value = body.get("input")
    items = value if isinstance(value, list) else [value]
    estimate = sum(
        len(item.encode()) // 4 + 1
        if isinstance(item, str)
        else len(item)
        if isinstance(item, list)
        else 1
        for item in items
    )
    await service.charge_tokens(tenant, estimate, 0)
    status, content = await service.relay_embeddings(model, raw)
    return Response(content, status_code=status, media_type="application/json")
