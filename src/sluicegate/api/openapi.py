"""The published OpenAPI document (``/openapi.json``, ``/docs``): the real request bodies
and the errors each route answers, in OpenAI's shape (400 for an invalid body, never 422).

The routes read their bodies themselves (to apply the limits before parsing), so FastAPI
cannot infer the bodies; they are published here from the same pydantic models that
validate them (:mod:`sluicegate.api.schemas`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from sluicegate import __version__
from sluicegate.api.schemas import ChatCompletionRequest, CompletionRequest

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_ERROR_TEXT = {
    "400": "Invalid request: the message names the parameter and the allowed values",
    "401": "Missing or unknown API key",
    "404": "Unknown model, route or id (another tenant's id included)",
    "405": "Method not allowed",
    "408": "The request's headers or body did not arrive in time",
    "410": "The stream's replay log has expired",
    "413": "Body larger than max_request_body_bytes (or a background job over max_job_bytes)",
    "415": "Body not sent as JSON",
    "429": "A limit was reached; Retry-After says when to retry",
    "503": "Not ready, draining, overloaded or the store is down; Retry-After says when",
}
_COMMON = ("401", "405", "503")
#: Error statuses by path (beyond :data:`_COMMON`); paths not listed answer none.
_ERRORS = {
    "/v1/chat/completions": ("400", "404", "408", "413", "415", "429"),
    "/v1/completions": ("400", "404", "408", "413", "415", "429"),
    "/v1/prefill": ("400", "404", "408", "413", "415", "429"),
    "/v1/models": (),
    "/v1/requests/{request_id}/cancel": ("404",),
    "/v1/streams/{stream_id}": ("400", "404", "410"),
    "/v1/jobs/{job_id}": ("404",),
    "/v1/files": ("400", "413"),
    "/v1/files/{file_id}": ("404",),
    "/v1/files/{file_id}/content": ("404",),
    "/v1/batches": ("400", "404", "408", "413", "415"),
    "/v1/batches/{batch_id}": ("404",),
    "/v1/batches/{batch_id}/cancel": ("404",),
}
_BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/prefill": "ChatCompletionRequest",
}
_BACKGROUND = {
    "type": "boolean",
    "default": False,
    "description": "Journal the request as a background job: answered 202 with a job id "
    "(GET /v1/jobs/{id}); cannot stream.",
}


def install_openapi(app: FastAPI) -> None:
    """Publish the document described in the module docstring as ``app.openapi()``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title,
        version=__version__,
        routes=app.routes,
        description="An OpenAI-compatible streaming LLM server with backpressure. Every "
        'error is `{"error": {"message", "type", "param", "code"}}`.',
    )
    _, definitions = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    # FastAPI's 422 shapes: this server answers 400 in OpenAI's shape instead.
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components.update(definitions.get("$defs", {}))
    components["Error"] = ERROR_SCHEMA
    for name in _BODIES.values():
        components[name]["properties"]["background"] = _BACKGROUND
    for path, item in schema["paths"].items():
        for operation in item.values():
            responses: dict[str, Any] = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in _ERRORS:
                for status in (*_COMMON, *_ERRORS[path]):
                    responses[status] = _error_response(status)
            if path in _BODIES:
                _publish_body(operation, _BODIES[path])
            operation["responses"] = dict(sorted(responses.items()))
    return schema


def _error_response(status: str) -> dict[str, Any]:
    return {
        "description": _ERROR_TEXT[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _publish_body(operation: dict[str, Any], model_name: str) -> None:
    operation["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model_name}"}}},
    }
    responses = operation["responses"]
    responses["200"] = {
        "description": "The answer (JSON), or with `stream: true` a stream of server-sent "
        "events ending with `data: [DONE]`",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    responses["202"] = {
        "description": "A background job was journaled (`background: true`)",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
