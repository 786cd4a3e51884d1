"""The prefill's bootstrap HTTP server (one per prefill instance, CLI default port 8998).

Where it sits in a request's life: docs/architecture.md, The path of one PD request. What it
holds (`PrefillRankInfo` per rank, `check_compatible`): bootstrap_info.py; the client that
registers, looks up and reports: bootstrap_client.py (both re-exported here).

Every prefill rank PUTs its `PrefillRankInfo` (KV layout, data-plane address, control-plane ZMQ
address, model name, the instance's `Handshake` (handshake.py) and an instance id that changes
when the prefill restarts); a decode GETs all ranks (or one), then runs `check_compatible` before
it registers with them. A decode that refuses the handshake registers nothing and POSTs a
`RefusalNotice` naming the rooms it refused, so the prefill fails them at once too.

    server = BootstrapServer("127.0.0.1", 8998).start()     # uvicorn in a daemon thread
    register_prefill_rank("127.0.0.1", server.port, info)   # each prefill rank, at startup
    inst = fetch_prefill_info(host, port)                   # decode; raises BootstrapError
    check_compatible(inst, DecodeInfo(model, tp, layouts))  # raises IncompatiblePeerError
    server.close()

HTTP API: `PUT /v1/prefill/ranks/{rank}` (JSON PrefillRankInfo), `GET /v1/prefill/ranks`
(503 until all tp_size ranks of the current instance registered), `GET /v1/prefill/ranks/{rank}`,
`POST /v1/prefill/refusals` (JSON RefusalNotice), `GET /health`. A registration with a new
instance id replaces the previous instance's ranks.

Who may register prefill ranks (issue 45, finding 6: a token holder re-registered a prefill's rank
0 with its own control address, and decodes would have sent their KV requests there). The shared
token cannot say: every decode holds it too, and a "prefill role key" derived from it is derived by
any holder just as well. What only the prefill instance has is a secret it makes itself: the
server runs in the instance's rank 0 process, which draws a random `registrar_key` at start and
hands it to its TP ranks with their start command (disagg/commands.py StartPrefill, over the TP
group's pipes, never the network). A rank registration (PUT) must be signed with that key instead
of the token, and must name the instance's own id (`prefill_instance`): a token holder's gets 401,
a replayed or relayed one too (the tag covers the endpoint, the server's id and a fresh nonce).

With an `Authenticator` (auth.py, the deployment's shared token) every call but /health must
carry a valid `X-Kvpipe-Auth` tag over its method, the endpoint it reached (this server's own
address and port as the accepted socket has it, ASGI's scope["server"], never a Host header: a
fake server that relays a decode's signed call here is refused), its path, the server's instance
id and its body: registrations (which would let anyone point decodes at their own control
endpoint) and look-ups (which hand out KV buffer addresses) alike. A call without one gets 401
and is counted (`auth_rejected`). The server's instance id is random per start and /health says
it: a client asks for it first, so a captured header works nowhere else and not after a restart
on the same port. Every 200 answer carries `X-Kvpipe-Auth-Reply`, a tag over the call's context,
timestamp and nonce and the answer's body; the client refuses an answer without a valid one.

Slow clients (issue 45, finding 7): the listener is the HTTP server's (kvpipe/http_listener.py)
with BOOTSTRAP_LISTENER_LIMITS: a connection that has not sent its request head within 10 s (its
body within 10 s more) gets 408 and is closed; a 257th open one takes the place of the one that
has waited longest for its client, or gets 503 at once if all 256 have a request in.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvpipe.body_limit import BodyLimitMiddleware
from kvpipe.config import ListenerLimits
from kvpipe.http_listener import listener_settings
from kvpipe.transfer.control.auth import HTTP_HEADER, REPLY_HEADER, Authenticator, AuthError, http_context
from kvpipe.transfer.control.bootstrap_client import (
    endpoint_of,
    fetch_prefill_info,
    fetch_prefill_rank,
    register_prefill_rank,
    report_refusal,
    wait_prefill_info,
)
from kvpipe.transfer.control.bootstrap_info import (
    DEFAULT_BOOTSTRAP_PORT,
    MALFORMED,
    MAX_ANSWER_BYTES,
    MAX_BODY_BYTES,
    BootstrapError,
    BootstrapNotReady,
    BootstrapRefused,
    BootstrapUnreachable,
    DecodeInfo,
    IncompatiblePeerError,
    PrefillInstanceInfo,
    PrefillRankInfo,
    check_compatible,
    layout_from_dict,
)
from kvpipe.transfer.control.handshake import RefusalNotice

# A bootstrap call is one small request per connection (clients send Connection: close): its head
# and its body within 10 s each, at most 256 connections at once (decodes fetch once per prefill
# instance, ranks register once); issue 45, finding 7.
BOOTSTRAP_LISTENER_LIMITS = ListenerLimits(
    header_timeout_s=10.0, body_timeout_s=10.0, keep_alive_s=5.0, max_connections=256
)

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "BootstrapError",
    "BootstrapNotReady",
    "BootstrapRefused",
    "BootstrapServer",
    "BootstrapUnreachable",
    "DecodeInfo",
    "IncompatiblePeerError",
    "PrefillInstanceInfo",
    "PrefillRankInfo",
    "check_compatible",
    "fetch_prefill_info",
    "fetch_prefill_rank",
    "layout_from_dict",
    "register_prefill_rank",
    "report_refusal",
    "wait_prefill_info",
]


class _Registry:
    """Registrations of the current prefill instance (thread-safe; FastAPI runs sync handlers in a pool)."""

    def __init__(self, prefill_instance: str | None = None) -> None:
        """`prefill_instance`: the one prefill instance that may register (the server runs in its
        rank 0's process); None: any, a new one replacing the last (tests, a shared server)."""
        self._lock = threading.Lock()
        self.auth_rejected = 0  # calls without a valid tag (with an Authenticator)
        self._pinned = prefill_instance
        self._instance: str | None = None
        self._ranks: dict[int, PrefillRankInfo] = {}

    def reject(self) -> None:
        with self._lock:
            self.auth_rejected += 1

    def put(self, rank: int, info: PrefillRankInfo) -> None:
        if info.rank != rank or not 0 <= rank < info.tp_size:
            raise HTTPException(400, f"rank {rank} in path, {info.rank} in body, tp_size {info.tp_size}")
        if self._pinned is not None and info.instance_id != self._pinned:
            raise HTTPException(403, "this bootstrap server registers the ranks of its own prefill instance only")
        with self._lock:
            if info.instance_id != self._instance:  # first registration, or the prefill restarted
                self._instance, self._ranks = info.instance_id, {}
            for other in self._ranks.values():
                if (other.tp_size, other.model_name) != (info.tp_size, info.model_name) and other.rank != rank:
                    raise HTTPException(
                        409,
                        f"rank {rank} registers tp_size {info.tp_size} model "
                        f"{info.model_name!r}; rank {other.rank} of the same instance "
                        f"has tp_size {other.tp_size} model {other.model_name!r}",
                    )
                if other.handshake != info.handshake and other.rank != rank:
                    raise HTTPException(409, f"rank {rank} registers another handshake than rank {other.rank}")
            self._ranks[rank] = info

    def get_all(self) -> dict[str, Any]:
        with self._lock:
            ranks = dict(self._ranks)
            instance = self._instance
        if not ranks:
            raise HTTPException(503, "no prefill rank registered yet")
        tp = next(iter(ranks.values())).tp_size
        if len(ranks) < tp:
            raise HTTPException(503, f"prefill instance {instance}: {len(ranks)}/{tp} ranks registered")
        first = ranks[0]
        return {
            "instance_id": instance,
            "tp_size": tp,
            "model_name": first.model_name,
            "ranks": [ranks[r].to_dict() for r in range(tp)],
        }

    def get_one(self, rank: int) -> dict[str, Any]:
        with self._lock:
            info = self._ranks.get(rank)
        if info is None:
            raise HTTPException(404, f"prefill rank {rank} not registered")
        return info.to_dict()


def _app(
    registry: _Registry,
    auth: Authenticator | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    instance: str | None = None,
    on_refusal: Callable[[RefusalNotice], None] | None = None,
    registrar: Authenticator | None = None,
) -> FastAPI:
    """`instance`: this server's id in every tag (random when not given); `on_refusal`: called
    (on a server thread) with every refusal notice a decode posts; `registrar`: what a rank
    registration (PUT) is signed with instead of `auth` (the prefill instance's own key)."""
    server_id = instance or secrets.token_hex(12)

    def signer(request: Request) -> Authenticator | None:
        return registrar if registrar is not None and request.method == "PUT" else auth

    def context(request: Request) -> bytes:
        # the endpoint this connection reached: the accepted socket's local address (one of ours)
        host, port = request.scope.get("server") or ("", 0)
        try:
            endpoint = endpoint_of(host, port or 0)
        except ValueError:  # not an IP (an in-process test client's "testserver"): as it is
            endpoint = f"{host}:{port}"
        return http_context(request.method, endpoint, request.url.path, server_id)

    async def authenticated(request: Request) -> None:
        checker = signer(request)
        if checker is None or request.url.path == "/health":
            return
        body = await request.body()  # cached on the request: the route's body parsing reads it again
        try:
            request.state.auth_stamp = checker.verify_http(context(request), body, request.headers.get(HTTP_HEADER))
        except AuthError as e:
            registry.reject()
            raise HTTPException(401, f"bootstrap call rejected: {e}") from None

    def answer(request: Request, payload: dict[str, Any]) -> JSONResponse:
        """A 200 answer; with a token, tagged over the call it answers."""
        resp = JSONResponse(payload)
        checker = signer(request)
        if checker is not None:
            resp.headers[REPLY_HEADER] = checker.sign_reply(
                context(request), request.state.auth_stamp, bytes(resp.body)
            )
        return resp

    app = FastAPI(
        title="kvpipe bootstrap", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(authenticated)]
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the input, and a body of `Infinity` cannot be written back as
        # JSON (the answer became a 500): say where and what, never the input
        where = "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in exc.errors()
        )
        return JSONResponse({"detail": where or "invalid request"}, status_code=422)

    @app.put("/v1/prefill/ranks/{rank}")
    def put_rank(rank: int, body: dict[str, Any], request: Request) -> JSONResponse:
        try:
            info = PrefillRankInfo.from_dict(body)
        except BootstrapError as e:
            raise HTTPException(400, str(e)) from e
        registry.put(rank, info)
        return answer(request, {"status": "ok"})

    @app.post("/v1/prefill/refusals")
    def post_refusal(body: dict[str, Any], request: Request) -> JSONResponse:
        try:
            notice = RefusalNotice.from_dict(body)
        except MALFORMED as e:
            raise HTTPException(400, f"malformed refusal notice: {e}") from e
        if on_refusal is not None:
            on_refusal(notice)
        return answer(request, {"status": "ok"})

    @app.get("/v1/prefill/ranks")
    def get_ranks(request: Request) -> JSONResponse:
        return answer(request, registry.get_all())

    @app.get("/v1/prefill/ranks/{rank}")
    def get_rank(rank: int, request: Request) -> JSONResponse:
        return answer(request, registry.get_one(rank))

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "instance": server_id}

    return app


class BootstrapServer:
    """uvicorn serving the registry from a daemon thread; port 0 picks a free port."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: Authenticator | None = None,
        on_refusal: Callable[[RefusalNotice], None] | None = None,
        *,
        registrar_key: bytes | None = None,
        prefill_instance: str | None = None,
        limits: ListenerLimits = BOOTSTRAP_LISTENER_LIMITS,
    ) -> None:
        """`registrar_key`: rank registrations must be signed with it (its prefill instance's
        own secret, handed to the instance's ranks; None: with `auth`, like every other call);
        `prefill_instance`: the only instance id that may register (None: any); `limits`: slow
        and too many clients (kvpipe/http_listener.py)."""
        self.host = host
        self.registrar_key = registrar_key
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound now, so `port` is known before start()
        self.port: int = self._sock.getsockname()[1]
        self._registry = _Registry(prefill_instance)
        self.instance = secrets.token_hex(12)  # in every tag: new on every start
        registrar = None if registrar_key is None else Authenticator(registrar_key)
        app = _app(self._registry, auth, instance=self.instance, on_refusal=on_refusal, registrar=registrar)
        cfg = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **listener_settings(limits))
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"bootstrap-{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        return str(httpx.URL(scheme="http", host=self.host, port=self.port))

    @property
    def auth_rejected(self) -> int:
        return self._registry.auth_rejected

    def start(self, timeout_s: float = 10.0) -> BootstrapServer:
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.close()
                raise BootstrapError(f"bootstrap server on {self.url} failed to start")
            time.sleep(0.01)
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
