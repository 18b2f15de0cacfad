"""Error handlers: every error a client sees is in OpenAI's shape (:mod:`sluicegate.errors`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from sluicegate.errors import APIError


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for part in parts:
        if part.isdigit():
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.to_response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        code = None
        if status == 404:
            message = "Not found: no such route. See GET /v1/models and POST /v1/chat/completions."
            code = "unknown_url"
        elif status == 405:
            allowed = (exc.headers or {}).get("allow", "")
            message = f"Method {request.method} is not allowed here; use {allowed or 'another'}."
            code = "method_not_allowed"
        else:
            message = str(exc.detail)
        return APIError(status, message, code=code, headers=dict(exc.headers or {})).to_response()

    async def on_unexpected_error(_: Request, __: Exception) -> Response:
        # A bug, not a client error: answered in the same shape (Starlette then re-raises
        # it, and uvicorn logs its traceback).
        return APIError(
            500,
            "The server failed unexpectedly; the request was not completed. Retry; if it "
            "keeps failing, report it with the time of the request.",
            code="internal_error",
        ).to_response()

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        # OpenAI answers plain validation errors with 400, never 422.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _loc_to_param(tuple(first.get("loc", ())))
        return APIError(400, f"{param}: {first.get('msg')}", param=param).to_response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected_error)
