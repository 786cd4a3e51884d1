"""Who is calling the HTTP API: SGLang's `--api-key` for users and kvpipe's `--admin-api-key`
for operators, as `Authorization: Bearer <key>`.

Roles. An admin may do everything; a user everything but the admin routes: `/debug/*` (other
users' requests and timelines), `abort_all` (every user's requests), and the addresses and
paths in `/server_info` and `/model_info` (a user sees what sglang-router needs, with those
fields left out). Without any key the server is open and every caller is an admin (a loopback
development server); with user keys only, nobody may use the admin routes (403 says which flag
turns them on); with an admin key only, the user routes stay open and the admin routes need it.
No key or a wrong one where one is needed is a 401, a user key on an admin route a 403.

Several user keys (`--api-key-file`, one per line) give users separate identities (`Caller
.key_id`, a hash of the key): abort by rid reaches only the key's own requests, and
`--cache-salt-by-api-key` keeps their prefix caches apart. Behind sglang-router every request
carries the router's one key, so there the users share one identity.

As in SGLang's server, `/health`, `/health_generate` and `/metrics` stay open (load balancers,
the launcher's health polls and Prometheus scrapers carry no key; sglang-router sends its
`--api-key` on every other call, and none on its health checks) and so does an OPTIONS
preflight. The check is an ASGI middleware, so a refused request is answered before its body is
read, and the keys are compared in constant time (both sides hashed first, so not even a
length leaks; every key is compared, so not even which one matched).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpipe.server.errors import APIError, error_body

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
ADMIN_PATH_PREFIXES = ("/debug/",)
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvpipe"'}  # RFC 6750: how to authenticate
CALLER_SCOPE_KEY = "kvpipe.caller"


class Role(enum.Enum):
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True)
class Caller:
    role: Role
    key_id: str | None = None  # `key_id` of the key presented; None: none was needed or given

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


OPEN_SERVER = Caller(Role.ADMIN)  # a server without keys: everyone


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """A key's public name (logs, ownership, cache salts): not the key, and not enough to find it."""
    return hashlib.sha256(b"kvpipe key id\0" + key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of `Authorization: Bearer <token>` (the scheme is case-insensitive)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(authorization: str | None, key: str) -> bool:
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(_digest(token), _digest(key))


@dataclass(frozen=True)
class AccessKeys:
    """The server's keys; `caller` tells who presented what."""

    user: tuple[str, ...] = ()
    admin: str | None = None

    def __post_init__(self) -> None:
        if any(not k for k in self.user) or self.admin == "":
            raise ValueError("an empty API key would let every request in")

    def __repr__(self) -> str:  # configs and errors get logged: never the keys
        return f"AccessKeys(user={len(self.user)} keys, admin={'set' if self.admin else 'none'})"

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller, or None when a key is needed and none of ours was presented."""
        if not self.user and self.admin is None:
            return OPEN_SERVER
        token = bearer_token(authorization)
        given = _digest(token) if token is not None else b""
        admin = self.admin is not None and hmac.compare_digest(given, _digest(self.admin))
        users = [k for k in self.user if hmac.compare_digest(given, _digest(k))]  # every key compared
        if admin:
            return Caller(Role.ADMIN, key_id(self.admin or ""))
        if users:
            return Caller(Role.USER, key_id(users[0]))
        return None if self.user else Caller(Role.USER)


def tenant_salt(caller: Caller, requested: str | None, by_key: bool) -> str | None:
    """The prefix-cache namespace of a request: its `cache_salt` (vLLM's field: prefixes are
    shared only between requests that send the same one), within its key's own namespace under
    --cache-salt-by-api-key; None: the shared one."""
    if by_key and caller.key_id is not None:
        return caller.key_id if requested is None else f"{caller.key_id}:{requested}"
    return requested


def caller_of(conn: HTTPConnection) -> Caller:
    """Who sent this request (set by `APIKeyMiddleware`)."""
    caller = conn.scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else OPEN_SERVER


def admin_refusal(caller: Caller | None, what: str) -> APIError | None:
    """Why `caller` may not do `what` (an admin's right), or None when it may."""
    if caller is not None and caller.is_admin:
        return None
    if caller is None or caller.key_id is None:
        return APIError(
            f"{what} needs the admin key: send `Authorization: Bearer <key>` (--admin-api-key)", 401, headers=CHALLENGE
        )
    return APIError(f"{what} needs the admin key (--admin-api-key); a user key is not enough", 403)


def require_admin(conn: HTTPConnection, what: str) -> None:
    refusal = admin_refusal(caller_of(conn), what)
    if refusal is not None:
        raise refusal


class APIKeyMiddleware:
    """`app.add_middleware(APIKeyMiddleware, keys=AccessKeys(...))`: 401 without a key where one
    is needed, 401/403 on admin routes for non-admins, in the API's error shape; the caller is
    left in the scope for the routes (`caller_of`)."""

    def __init__(self, app: ASGIApp, keys: AccessKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        authorization = Headers(scope=scope).get("authorization")
        caller = self.keys.caller(authorization)
        path = scope["path"]
        if scope["method"] == "OPTIONS" or path in OPEN_PATHS:
            scope[CALLER_SCOPE_KEY] = caller or Caller(Role.USER)
            return await self.app(scope, receive, send)
        refusal: APIError | None = None
        if caller is None:
            what = "a wrong API key" if bearer_token(authorization) is not None else "no API key"
            refusal = APIError(
                f"{what}: this server needs the header `Authorization: Bearer <key>` (--api-key)",
                401,
                headers=CHALLENGE,
            )
        elif path.startswith(ADMIN_PATH_PREFIXES):
            refusal = admin_refusal(caller, path)
            if refusal is not None and self.keys.admin is None:
                refusal = APIError(f"{path} is an admin route, and this server has no --admin-api-key", 403)
        if refusal is not None:
            body = error_body(refusal.message, refusal.status)
            await JSONResponse(body, status_code=refusal.status, headers=refusal.headers)(scope, receive, send)
            return None
        scope[CALLER_SCOPE_KEY] = caller
        return await self.app(scope, receive, send)
