"""What the server's /openapi.json says about request bodies and error answers.

The routes read their bodies themselves (`read_json` + `Model.model_validate`): an empty or
malformed body, or a field of the wrong type, must give the server's own 400 shape, not
FastAPI's 422. So FastAPI cannot see the bodies; here the wire models are written into the
schema by hand (`openapi_extra`), which changes nothing a request meets but documents every
field and lets a schema fuzzer (tests/integration/test_server_schema_fuzz.py) build real
requests.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvpipe.config import RequestLimits
from kvpipe.server.api_key import ADMIN_PATH_PREFIXES, OPEN_PATHS, AccessKeys
from kvpipe.server.protocol import DEFAULT_LIMITS
from kvpipe.server.request_caps import REF, apply_limits, request_defs


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """Every refused request: `{"error": {"message", "type", "param", "code"}}` (errors.py)."""

    error: ErrorDetail


# what a body route answers: JSON, or with "stream": true server-sent events; else a refused
# request, an unknown model (OpenAI routes), a body over --max-request-body-bytes, a refused PD
# handshake, a prefill that failed (PD), the engine still loading
BODY_ROUTE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    **{
        status: {"model": ErrorBody, "description": what}
        for status, what in (
            (400, "invalid request, or over a cap of the request limits (--max-prompts-per-request, ...)"),
            (401, "no API key, or a wrong one (--api-key)"),
            (404, "unknown model"),
            (409, "PD: the prefill and decode refused each other's handshake (the message names both sides' values)"),
            (413, "request body too large"),
            (415, "the body is not sent as application/json"),
            (500, "the prefill of a PD request failed"),
            (503, "the engine is loading or failed, or the server is full (then with Retry-After)"),
        )
    },
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose handler validates its JSON body with `model`."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


NO_KEYS = AccessKeys()
ADMIN_ROUTES = ("/abort_request",)  # may need the admin key, by what the body asks (abort_all)


def _document_keys(schema: dict[str, Any], keys: AccessKeys) -> None:
    """Which operations need a bearer key (every one but the open probes with user keys; the
    admin routes with an admin key only) and may answer 401, and which 403 (a user key where the
    admin key is needed)."""
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model=ErrorBody.__name__)}}}}
    for path, ops in schema.get("paths", {}).items():
        admin = path.startswith(ADMIN_PATH_PREFIXES) or path in ADMIN_ROUTES
        if path in OPEN_PATHS or not (keys.user or admin):
            continue
        for op in ops.values():
            responses = op.setdefault("responses", {})
            # with an admin key only, a user route that turns admin by its body takes no key too
            op["security"] = [{"bearer": []}] if keys.user or path not in ADMIN_ROUTES else [{"bearer": []}, {}]
            responses.setdefault("401", {"description": "no API key, or a wrong one", **error})
            if admin:
                responses.setdefault("403", {"description": "a user key where the admin key is needed", **error})


def install_body_schemas(
    app: FastAPI, models: list[type[BaseModel]], limits: RequestLimits = DEFAULT_LIMITS, keys: AccessKeys = NO_KEYS
) -> None:
    """Add `models` (and the models they nest) to the schema's components, for `json_body` refs,
    with the server's caps written in, and which routes need which key."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            defs = request_defs(tuple(models))
            apply_limits(defs, limits)  # the requests' caps; the answers have none
            # ErrorBody too: the 401 answers _document_keys declares refer to it
            schema.setdefault("components", {}).setdefault("schemas", {}).update({**request_defs((ErrorBody,)), **defs})
            if keys.user or keys.admin is not None:
                _document_keys(schema, keys)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
