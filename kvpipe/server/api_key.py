"""SGLang's `--api-key` for the HTTP API: `Authorization: Bearer <key>` on every route but the
probes.

As in SGLang's server, `/health`, `/health_generate` and `/metrics` stay open (load balancers,
the launcher's health polls and Prometheus scrapers carry no key; sglang-router sends its
`--api-key` on every other call, and none on its health checks) and so does an OPTIONS
preflight; everything else, the admin route `/abort_request` and `/openapi.json` included,
answers 401 without the key. The check is an ASGI middleware, so a refused request is answered
before its body is read, and the key is compared in constant time (both sides hashed first, so
not even its length leaks).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpipe.server.errors import error_body

API_KEY_ENV = "KVPIPE_API_KEY"  # read when --api-key is not given: it stays out of process lists
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvpipe"'}  # RFC 6750: how to authenticate


def api_key_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    return environ.get(API_KEY_ENV) or None


def client_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What kvpipe's own clients (bench, soak, chaos, chat) send: `Authorization: Bearer <key>`
    when KVPIPE_API_KEY is set, else nothing."""
    key = api_key_from_env(environ)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of `Authorization: Bearer <token>` (the scheme is case-insensitive)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(authorization: str | None, key: str) -> bool:
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(_digest(token), _digest(key))


class APIKeyMiddleware:
    """`app.add_middleware(APIKeyMiddleware, api_key=...)`: 401 without the key, in the API's
    error shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let every request in")
        self.app, self._key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        authorization = Headers(scope=scope).get("authorization")
        if key_matches(authorization, self._key):
            return await self.app(scope, receive, send)
        what = "a wrong API key" if bearer_token(authorization) is not None else "no API key"
        message = f"{what}: this server needs the header `Authorization: Bearer <key>` (--api-key)"
        response = JSONResponse(error_body(message, 401), status_code=401, headers=CHALLENGE)
        await response(scope, receive, send)
