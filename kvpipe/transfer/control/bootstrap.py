"""The prefill's bootstrap HTTP server and the decode's client for it.

Where they sit in a request's life: docs/architecture.md, The path of one PD request.

One server per prefill instance (CLI default port 8998). Every prefill rank PUTs its
`PrefillRankInfo` (KV layout, data-plane address, control-plane ZMQ address, model name, the
instance's `Handshake` (handshake.py) and an instance id that changes when the prefill restarts); a
decode GETs all ranks (or one), then runs `check_compatible` before it registers with them. A
decode that refuses the handshake registers nothing and POSTs a `RefusalNotice` naming the rooms
it refused, so the prefill fails them at once too (the decode's requests fail with the same
reason).

    server = BootstrapServer("127.0.0.1", 8998).start()     # uvicorn in a daemon thread
    register_prefill_rank("127.0.0.1", server.port, info)   # each prefill rank, at startup
    inst = fetch_prefill_info(host, port)                   # decode; raises BootstrapError
    check_compatible(inst, DecodeInfo(model, tp, layouts))  # raises IncompatiblePeerError
    server.close()

HTTP API: `PUT /v1/prefill/ranks/{rank}` (JSON PrefillRankInfo), `GET /v1/prefill/ranks`
(503 until all tp_size ranks of the current instance registered), `GET /v1/prefill/ranks/{rank}`,
`POST /v1/prefill/refusals` (JSON RefusalNotice), `GET /health`. A registration with a new
instance id replaces the previous instance's ranks.

With an `Authenticator` (auth.py, the deployment's shared token) every call but /health must
carry a valid `X-Kvpipe-Auth` tag over its method, the host:port it was addressed to, its path,
the server's instance id and its body: registrations (which would let anyone point decodes at
their own control endpoint) and look-ups (which hand out KV buffer addresses) alike. A call
without one gets 401 and is counted (`auth_rejected`). The server's instance id is random per
start and /health says it: a client asks for it first, so a captured header works nowhere else
and not after a restart on the same port. Every 200 answer carries `X-Kvpipe-Auth-Reply`, a tag
over the call's context, timestamp and nonce and the answer's body; the client refuses an answer
without a valid one. The client reads at most `MAX_ANSWER_BYTES` of an answer, and gives up on a
call after twice its timeout even when the server trickles bytes.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kvpipe.body_limit import BodyLimitMiddleware
from kvpipe.transfer.control.auth import HTTP_HEADER, REPLY_HEADER, Authenticator, AuthError, http_context
from kvpipe.transfer.control.handshake import REFUSED, Handshake, Mismatch, RefusalNotice, compare, describe, refusal
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range, transfer_slices

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's convention; the router sends null for "default"
# A registration is a few KB (two addresses per layer); anything near this is garbage or an attack.
MAX_BODY_BYTES = 1 << 20
# An answer holds one registration per prefill rank: a decode reads at most this much of one
# (an unbounded read let a bogus bootstrap host fill the decode's memory).
MAX_ANSWER_BYTES = 16 * MAX_BODY_BYTES
# What a field of hostile JSON can make int()/KVLayout raise: 1e400 parses as inf, int(inf) overflows.
_MALFORMED = (KeyError, TypeError, ValueError, OverflowError)


class BootstrapError(RuntimeError):
    """The bootstrap server is unreachable, not ready, or answered something unusable."""


class BootstrapNotReady(BootstrapError):
    """The server is up but not every prefill rank has registered yet (worth retrying)."""


class BootstrapUnreachable(BootstrapError):
    """No HTTP answer: connection refused or timed out (worth retrying while the prefill starts)."""


class IncompatiblePeerError(BootstrapError):
    """Prefill and decode cannot exchange KV (model, page size, dtype, layers, TP ...): a refused
    handshake. `mismatches` names each disagreement; `reason` is the first one's /metrics label."""

    def __init__(self, message: str, reason: str, mismatches: tuple[Mismatch, ...] = ()) -> None:
        super().__init__(message if message.startswith(REFUSED) else f"{REFUSED}: {message}")
        self.reason, self.mismatches = reason, mismatches

    @classmethod
    def of(cls, mismatches: tuple[Mismatch, ...], where: str) -> IncompatiblePeerError:
        return cls(f"{describe(mismatches)} ({where})", mismatches[0].reason, mismatches)


class BootstrapRefused(BootstrapError, ValueError):
    """This decode may not fetch from that bootstrap address (--disaggregation-bootstrap-allow,
    or it failed a moment ago). A ValueError too: the engine refuses the request with it."""


def layout_from_dict(d: dict[str, Any]) -> KVLayout:
    return KVLayout(
        **{
            **d,
            "buffer_addrs": tuple(int(a) for a in d["buffer_addrs"]),
            "swa_layers": tuple(int(i) for i in d.get("swa_layers", ())),
        }
    )


@dataclass(frozen=True)
class PrefillRankInfo:
    rank: int
    tp_size: int
    layout: KVLayout
    data_address: str  # transfer backend address of this rank ("ip:port" for Mooncake)
    control_address: str  # ZMQ PULL address of this rank's KVSender ("tcp://ip:port")
    model_name: str
    instance_id: str  # new value on every prefill (re)start
    handshake: Handshake | None = None  # what a decode must agree with (None: not checked, tests)

    def to_dict(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["layout"] = self.layout.to_dict()
        d["layout"]["buffer_addrs"] = list(self.layout.buffer_addrs)
        d["handshake"] = None if self.handshake is None else self.handshake.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillRankInfo:
        try:
            return cls(
                rank=int(d["rank"]),
                tp_size=int(d["tp_size"]),
                layout=layout_from_dict(d["layout"]),
                data_address=str(d["data_address"]),
                control_address=str(d["control_address"]),
                model_name=str(d["model_name"]),
                instance_id=str(d["instance_id"]),
                handshake=None if d.get("handshake") is None else Handshake.from_dict(d["handshake"]),
            )
        except _MALFORMED as e:
            raise BootstrapError(f"malformed prefill rank info: {e!r}") from e


@dataclass(frozen=True)
class PrefillInstanceInfo:
    instance_id: str
    tp_size: int
    model_name: str
    ranks: tuple[PrefillRankInfo, ...]  # ranks[i].rank == i

    @property
    def handshake(self) -> Handshake | None:
        """The instance's handshake (every rank registers the same one: _Registry.put)."""
        return self.ranks[0].handshake if self.ranks else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillInstanceInfo:
        try:
            ranks = tuple(sorted((PrefillRankInfo.from_dict(r) for r in d["ranks"]), key=lambda r: r.rank))
            inst = cls(str(d["instance_id"]), int(d["tp_size"]), str(d["model_name"]), ranks)
        except _MALFORMED as e:
            raise BootstrapError(f"malformed prefill instance info: {e!r}") from e
        if [r.rank for r in ranks] != list(range(inst.tp_size)):
            raise BootstrapError(
                f"prefill instance {inst.instance_id}: ranks {[r.rank for r in ranks]} "
                f"do not cover tp_size {inst.tp_size}"
            )
        return inst


@dataclass(frozen=True)
class DecodeInfo:
    model_name: str
    tp_size: int
    layouts: tuple[KVLayout, ...]  # one per decode rank
    handshake: Handshake | None = None  # None: not checked (tests that build bare senders and receivers)


def check_compatible(prefill: PrefillInstanceInfo, decode: DecodeInfo) -> None:
    """Raise IncompatiblePeerError naming both sides' values if KV cannot move from `prefill`
    to `decode`: the served model name, the handshakes (handshake.py: every field they disagree
    on), each rank pair's layout, the TP mapping."""
    where = f"prefill instance {prefill.instance_id}"
    if prefill.model_name != decode.model_name:
        raise IncompatiblePeerError.of(
            refusal("served model name", "model_name", prefill.model_name, decode.model_name), where
        )
    mine, theirs = decode.handshake, prefill.handshake
    if (mine is None) != (theirs is None):
        has = lambda h: "a handshake" if h is not None else "none"  # noqa: E731
        raise IncompatiblePeerError.of(refusal("handshake", "handshake", has(theirs), has(mine)), where)
    if mine is not None and theirs is not None:
        mismatches = compare(theirs, mine)
        if mismatches:
            raise IncompatiblePeerError.of(mismatches, where)
    if len(decode.layouts) != decode.tp_size:
        raise IncompatiblePeerError(f"decode has tp_size {decode.tp_size} but {len(decode.layouts)} layouts", "tp")
    for p in prefill.ranks:
        for d_rank, d in enumerate(decode.layouts):
            why = p.layout.compatible_with(d)
            if why:
                raise IncompatiblePeerError(
                    f"{where} rank {p.rank} vs decode rank {d_rank}: "
                    + why.replace(" here ", " on the prefill ").replace("on the peer", "on the decode"),
                    "kv_layout",
                )
    total = decode.layouts[0].total_kv_heads
    try:
        transfer_slices(prefill.tp_size, decode.tp_size, total)
        for side, tp, layouts in (
            ("prefill", prefill.tp_size, [p.layout for p in prefill.ranks]),
            ("decode", decode.tp_size, decode.layouts),
        ):
            for rank, lay in enumerate(layouts):
                want = kv_head_range(tp, rank, total)
                if (lay.head_start, lay.head_end) != want:
                    raise ValueError(
                        f"{side} rank {rank} holds KV heads [{lay.head_start}, {lay.head_end}), "
                        f"TP {tp} needs [{want[0]}, {want[1]})"
                    )
    except ValueError as e:
        raise IncompatiblePeerError(f"{where}: TP {prefill.tp_size} -> decode TP {decode.tp_size}: {e}", "tp") from e


class _Registry:
    """Registrations of the current prefill instance (thread-safe; FastAPI runs sync handlers in a pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.auth_rejected = 0  # calls without a valid tag (with an Authenticator)
        self._instance: str | None = None
        self._ranks: dict[int, PrefillRankInfo] = {}

    def reject(self) -> None:
        with self._lock:
            self.auth_rejected += 1

    def put(self, rank: int, info: PrefillRankInfo) -> None:
        if info.rank != rank or not 0 <= rank < info.tp_size:
            raise HTTPException(400, f"rank {rank} in path, {info.rank} in body, tp_size {info.tp_size}")
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
) -> FastAPI:
    """`instance`: this server's id in every tag (random when not given); `on_refusal`: called
    (on a server thread) with every refusal notice a decode posts."""
    server_id = instance or secrets.token_hex(12)

    def context(request: Request) -> bytes:
        return http_context(request.method, request.headers.get("host", ""), request.url.path, server_id)

    async def authenticated(request: Request) -> None:
        if auth is None or request.url.path == "/health":
            return
        body = await request.body()  # cached on the request: the route's body parsing reads it again
        try:
            request.state.auth_stamp = auth.verify_http(context(request), body, request.headers.get(HTTP_HEADER))
        except AuthError as e:
            registry.reject()
            raise HTTPException(401, f"bootstrap call rejected: {e}") from None

    def answer(request: Request, payload: dict[str, Any]) -> JSONResponse:
        """A 200 answer; with a token, tagged over the call it answers."""
        resp = JSONResponse(payload)
        if auth is not None:
            resp.headers[REPLY_HEADER] = auth.sign_reply(context(request), request.state.auth_stamp, bytes(resp.body))
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
        except _MALFORMED as e:
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
    ) -> None:
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound now, so `port` is known before start()
        self.port: int = self._sock.getsockname()[1]
        self._registry = _Registry()
        self.instance = secrets.token_hex(12)  # in every tag: new on every start
        app = _app(self._registry, auth, instance=self.instance, on_refusal=on_refusal)
        cfg = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"bootstrap-{self.port}", daemon=True
        )

    @property
    def url(self) -> str:
        return _base_url(self.host, self.port)

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


def _base_url(host: str, port: int) -> str:
    return f"http://{_authority(host, port)}"


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _request(
    method: str,
    host: str,
    port: int,
    path: str,
    timeout_s: float,
    body: dict[str, Any] | None = None,
    auth: Authenticator | None = None,
    connect_to: str | None = None,
) -> Any:
    """One call (with a token: the instance look-up, then the signed call); every wait (connect,
    each read) is at most `timeout_s`, and the whole exchange stops reading after twice that (at
    least one second more), so a server that trickles bytes cannot hold the caller. `connect_to`:
    the address to connect to instead of resolving `host` again (the one an allow list checked).
    The answer is read up to MAX_ANSWER_BYTES; with a token it must carry a valid reply tag."""
    authority = _authority(host, port)
    base = _base_url(connect_to or host, port)
    url = _base_url(host, port) + path
    end = time.monotonic() + timeout_s + max(timeout_s, 1.0)
    content = b"" if body is None else json.dumps(body).encode()
    # a connection per exchange: a second request on a kept-alive loopback connection waited
    # ~40 ms for a delayed ACK (Nagle)
    headers = {"Host": authority, "Accept-Encoding": "identity", "Connection": "close"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        # verify=False: the bootstrap API is plain HTTP, and loading the CA bundle for a client
        # that never speaks TLS cost ~0.2 s per call on a loaded 2-core host
        with httpx.Client(timeout=timeout_s, trust_env=False, verify=False) as client:
            ctx = b""
            if auth is not None:
                status, raw, _ = _call(client, "GET", base + "/health", {**headers}, b"", end)
                ctx = http_context(method, authority, path, _instance(url, status, raw))
                headers[HTTP_HEADER] = auth.sign_http(ctx, content)
            status, raw, resp_headers = _call(client, method, base + path, headers, content, end)
    except httpx.TimeoutException as e:
        raise BootstrapUnreachable(f"bootstrap server {url}: no complete answer within {timeout_s}s") from e
    except httpx.HTTPError as e:
        raise BootstrapUnreachable(f"bootstrap server {url} unreachable: {e}") from e
    if status == 503:
        raise BootstrapNotReady(f"bootstrap server {url}: {_detail(raw)}")
    if status != 200:
        raise BootstrapError(f"bootstrap server {url}: HTTP {status}: {_detail(raw)}")
    if auth is not None:
        try:
            auth.verify_reply(ctx, headers[HTTP_HEADER], raw, resp_headers.get(REPLY_HEADER))
        except AuthError as e:
            raise BootstrapError(f"bootstrap server {url}: {e}") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise BootstrapError(f"bootstrap server {url}: answer is not JSON") from e


def _call(
    client: httpx.Client, method: str, url: str, headers: dict[str, str], content: bytes, end: float
) -> tuple[int, bytes, httpx.Headers]:
    """Status, body (at most MAX_ANSWER_BYTES) and headers of one exchange; no read starts after `end`."""
    with client.stream(method, url, content=content, headers=headers) as resp:
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
            raise BootstrapError(f"bootstrap server {url}: answer of {declared} bytes (at most {MAX_ANSWER_BYTES})")
        buf = bytearray()
        chunks = resp.iter_bytes()
        while True:
            if time.monotonic() > end:
                raise httpx.ReadTimeout("answer not complete in time")
            chunk = next(chunks, None)
            if chunk is None:
                break
            buf += chunk
            if len(buf) > MAX_ANSWER_BYTES:
                raise BootstrapError(f"bootstrap server {url}: answer longer than {MAX_ANSWER_BYTES} bytes")
        return resp.status_code, bytes(buf), resp.headers


def _instance(url: str, status: int, raw: bytes) -> str:
    """The server's instance id from its /health answer (what a signed call names)."""
    try:
        instance = json.loads(raw)["instance"] if status == 200 else None
    except (ValueError, KeyError, TypeError):
        instance = None
    if not isinstance(instance, str) or not 0 < len(instance) <= 64:
        raise BootstrapError(f"bootstrap server {url}: /health names no instance (HTTP {status}; not kvpipe?)")
    return instance


def _detail(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode(errors="replace")
    return str(body.get("detail", body))[:500] if isinstance(body, dict) else raw[:200].decode(errors="replace")


def register_prefill_rank(
    host: str, port: int, info: PrefillRankInfo, timeout_s: float = 2.0, auth: Authenticator | None = None
) -> None:
    _request("PUT", host, port, f"/v1/prefill/ranks/{info.rank}", timeout_s, info.to_dict(), auth)


def fetch_prefill_info(
    host: str, port: int, timeout_s: float = 2.0, auth: Authenticator | None = None, connect_to: str | None = None
) -> PrefillInstanceInfo:
    """`connect_to`: the checked address of `host` to connect to (allow lists, fetch_guard.py)."""
    return PrefillInstanceInfo.from_dict(
        _request("GET", host, port, "/v1/prefill/ranks", timeout_s, auth=auth, connect_to=connect_to)
    )


def report_refusal(
    host: str,
    port: int,
    notice: RefusalNotice,
    timeout_s: float = 2.0,
    auth: Authenticator | None = None,
    connect_to: str | None = None,
) -> None:
    """Tell the prefill's bootstrap server that this decode refused its handshake for `notice.rooms`."""
    _request("POST", host, port, "/v1/prefill/refusals", timeout_s, notice.to_dict(), auth, connect_to)


def fetch_prefill_rank(
    host: str, port: int, rank: int, timeout_s: float = 2.0, auth: Authenticator | None = None
) -> PrefillRankInfo:
    return PrefillRankInfo.from_dict(_request("GET", host, port, f"/v1/prefill/ranks/{rank}", timeout_s, auth=auth))


def wait_prefill_info(
    host: str,
    port: int,
    timeout_s: float,
    http_timeout_s: float = 2.0,
    retry_s: float = 0.05,
    stop: threading.Event | None = None,
    auth: Authenticator | None = None,
) -> PrefillInstanceInfo:
    """fetch_prefill_info, retrying unreachable / not-ready servers until `timeout_s` passed
    (or `stop` is set: then the last error is raised)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return fetch_prefill_info(host, port, min(http_timeout_s, max(0.05, end - time.monotonic())), auth)
        except (BootstrapUnreachable, BootstrapNotReady):
            # Unreachable and not-ready servers may heal (prefill starting); other errors will not.
            if time.monotonic() + retry_s >= end or (stop is not None and stop.is_set()):
                raise
        if stop is not None:
            stop.wait(retry_s)
        else:
            time.sleep(retry_s)
