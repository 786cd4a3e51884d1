"""API errors and their JSON shape: `{"error": {"message", "type", "code"}}` with an HTTP status.

Every rejected request ends here, whichever route or validation layer rejected it, so clients
(the `openai` package, sglang-router, curl) always see the same shape and the server keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# HTTP status -> OpenAI-style error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """A request the server refuses; `status` is the HTTP status code."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,  # e.g. Retry-After on a 503, WWW-Authenticate on a 401
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.headers = headers


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict[str, Any]:
    err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.status, exc.err_type, exc.param), status_code=exc.status, headers=exc.headers
    )


def describe_validation_error(exc: ValidationError | RequestValidationError) -> str:
    """One line per problem: `sampling_params.temperature: Input should be a valid number`."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise onto the JSON error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(describe_validation_error(exc), 400))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(APIError(describe_validation_error(exc), 400))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), exc.status_code, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request handler")
        return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}", 500))
