"""Errors a client sees, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Any stage may refuse a request with an :class:`APIError`; the api turns it into the
response (or the final stream event) the client gets.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    431: "invalid_request_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error a client sees.  ``message`` says what was wrong and what to do."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def event_body(self) -> dict[str, Any]:
        """The body as a stream's final event, which has no headers to say when to retry:
        ``retry_after_ms`` carries it instead (and ``refusal`` the
        ``x-sluicegate-refusal`` header)."""
        body = self.body()
        retry_ms = self.headers.get("retry-after-ms")
        if retry_ms is None and "retry-after" in self.headers:
            retry_ms = str(int(self.headers["retry-after"]) * 1000)
        if retry_ms is not None:
            body["error"]["retry_after_ms"] = int(retry_ms)
        # And x-sluicegate-refusal: whether a seat is held at that time.
        if (refusal := self.headers.get("x-sluicegate-refusal")) is not None:
            body["error"]["refusal"] = refusal
        return body

    def to_response(self) -> Response:
        return Response(
            content=orjson.dumps(self.body()),
            status_code=self.status_code,
            media_type="application/json",
            headers=self.headers,
        )


def invalid_param(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")
