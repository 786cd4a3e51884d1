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

from kvpipe.config import RequestLimits
from kvpipe.server.api_key import OPEN_PATHS
from kvpipe.server.protocol import DEFAULT_LIMITS, GENERATE_BATCH_FIELDS, WireModel

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


# per-prompt list fields of each request model: with more entries than a batch may have prompts,
# the body is refused (protocol.check_batch_size)
_BATCH_FIELDS = {
    "GenerateRequest": GENERATE_BATCH_FIELDS,
    "CompletionRequest": ("prompt", "bootstrap_host", "bootstrap_port", "bootstrap_room"),
    "ChatCompletionRequest": ("bootstrap_host", "bootstrap_port", "bootstrap_room"),
}


def _branches(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return prop.get("anyOf", [prop])


def _is_token_list(branch: dict[str, Any]) -> bool:
    """`[1, 2, 3]`: one prompt of token ids, not a batch."""
    return branch.get("type") == "array" and branch.get("items", {}).get("type") == "integer"


def apply_limits(defs: dict[str, Any], limits: RequestLimits) -> None:
    """Write the server's caps into the request schemas (maxItems, maxLength), so the schema
    says what a request may hold and a schema fuzzer tries the far side of each cap."""
    for name, model in defs.items():
        props = model.get("properties", {})
        for branch in _branches(props.get("stop", {})):
            if branch.get("type") == "string":
                branch["maxLength"] = limits.max_stop_string_chars
            elif branch.get("type") == "array":
                branch["maxItems"] = limits.max_stop_strings
                branch["items"]["maxLength"] = limits.max_stop_string_chars
        for branch in _branches(props.get("stop_token_ids", {})):
            if branch.get("type") == "array":
                branch["maxItems"] = limits.max_stop_token_ids
        for field in _BATCH_FIELDS.get(name, ()):
            for branch in _branches(props.get(field, {})):
                if branch.get("type") == "array" and not _is_token_list(branch):
                    branch["maxItems"] = limits.max_prompts_per_request


def _require_key(schema: dict[str, Any]) -> None:
    """Every operation but the open probes needs the bearer key, and may answer 401."""
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    error = {"$ref": REF.format(model=ErrorBody.__name__)}
    for path, ops in schema.get("paths", {}).items():
        if path in OPEN_PATHS:
            continue
        for op in ops.values():
            op["security"] = [{"bearer": []}]
            op.setdefault("responses", {}).setdefault(
                "401", {"description": "no API key, or a wrong one", "content": {"application/json": {"schema": error}}}
            )


def install_body_schemas(
    app: FastAPI, models: list[type[BaseModel]], limits: RequestLimits = DEFAULT_LIMITS, key_required: bool = False
) -> None:
    """Add `models` (and the models they nest) to the schema's components, for `json_body` refs,
    with the server's caps written in; `key_required`: the server runs with --api-key."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            # ErrorBody too: the 401 answers _require_key declares refer to it
            documented: list[type[BaseModel]] = [*models, ErrorBody]
            _, defs = models_json_schema([(m, "validation") for m in documented], ref_template=REF)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(defs.get("$defs", {}))
            apply_limits(components, limits)
            if key_required:
                _require_key(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
