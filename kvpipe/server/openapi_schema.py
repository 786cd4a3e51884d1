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
from pydantic.json_schema import models_json_schema

from kvpipe.server.protocol import WireModel

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """Every refused request: `{"error": {"message", "type", "param", "code"}}` (errors.py)."""

    error: ErrorDetail


class AbortRequest(WireModel):
    """Body of `POST /abort_request`: one request by rid, or all of them."""

    rid: str | None = None
    abort_all: bool = False


# what a body route answers: JSON, or with "stream": true server-sent events; else a refused
# request, an unknown model (OpenAI routes), a body over --max-request-body-bytes, a prefill that
# failed (PD), the engine still loading
BODY_ROUTE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}},
    **{
        status: {"model": ErrorBody, "description": what}
        for status, what in (
            (400, "invalid request"),
            (404, "unknown model"),
            (413, "request body too large"),
            (500, "the prefill of a PD request failed"),
            (503, "the engine is loading or failed"),
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


def install_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add `models` (and the models they nest) to the schema's components, for `json_body` refs."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
