"""The client of a prefill's bootstrap server: prefill ranks register, decodes look up and report.

    register_prefill_rank("127.0.0.1", port, info, auth=registrar)  # each prefill rank, at startup
    inst = fetch_prefill_info(host, port, auth=auth, connect_to=ip) # decode; raises BootstrapError
    report_refusal(host, port, notice, auth=auth, connect_to=ip)    # decode refused the handshake

Every call parses its address strictly (bootstrap_address.py) and builds its URL from the parts:
it connects to `connect_to` (the address an allow list checked, fetch_guard.py) or to the first
address the name resolves to, and nowhere else. With an `Authenticator` it first reads the
server's instance id from /health, then signs the call over the endpoint it connected to (that
IP and port, not a name or Host header anyone chose: a fake server that relays the signed call
to a real one with the same Host header is refused there, issue 45 finding 2), the path, the
instance id, a fresh nonce and the body; a 200 answer must carry a reply tag over that call and
the answer's body, checked before the answer is used. Errors name the server and the HTTP status,
never what the server said (issue 45 finding 1: a local service's error body reached the client
inside a 500); that goes to `BootstrapError.detail`, for the log. Every wait is bounded: each
read by the timeout, the whole exchange by twice it, the answer by MAX_ANSWER_BYTES.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from typing import Any

import httpx

from kvpipe.transfer.control.auth import HTTP_HEADER, REPLY_HEADER, Authenticator, AuthError, http_context
from kvpipe.transfer.control.bootstrap_address import BootstrapAddress, canonical_ip, parse_bootstrap_address
from kvpipe.transfer.control.bootstrap_info import (
    MAX_ANSWER_BYTES,
    BootstrapError,
    BootstrapNotReady,
    BootstrapUnreachable,
    PrefillInstanceInfo,
    PrefillRankInfo,
)
from kvpipe.transfer.control.handshake import RefusalNotice


def endpoint_of(ip: str, port: int) -> str:
    """What a signed call names: the IP (canonical: an IPv4-mapped address as IPv4) and port a
    client connected to, which the server reads back from its accepted socket."""
    return str(BootstrapAddress(str(canonical_ip(ipaddress.ip_address(ip))), port))


def resolve_first(host: str) -> str:
    """The address a connection to `host` goes to: itself if a literal, else its first resolved one."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError) as e:
        raise BootstrapUnreachable(f"bootstrap host {host} does not resolve", str(e)) from None


def _request(
    method: str,
    host: str,
    port: int | None,
    path: str,
    timeout_s: float,
    body: dict[str, Any] | None = None,
    auth: Authenticator | None = None,
    connect_to: str | None = None,
) -> Any:
    """One call (with a token: the instance look-up, then the signed call) to `host`:`port`,
    connecting to `connect_to` when given; the module docstring says what is checked."""
    addr = parse_bootstrap_address(host, port)  # BootstrapRefused: nothing connects anywhere
    ip = connect_to or resolve_first(addr.host)
    where = f"bootstrap server {addr}"
    end = time.monotonic() + timeout_s + max(timeout_s, 1.0)
    content = b"" if body is None else json.dumps(body).encode()
    # a connection per exchange: a second request on a kept-alive loopback connection waited
    # ~40 ms for a delayed ACK (Nagle)
    headers = {"Host": str(addr), "Accept-Encoding": "identity", "Connection": "close"}
    if body is not None:
        headers["Content-Type"] = "application/json"

    def url(p: str) -> httpx.URL:
        return httpx.URL(scheme="http", host=ip, port=addr.port, path=p)

    try:
        # verify=False: the bootstrap API is plain HTTP, and loading the CA bundle for a client
        # that never speaks TLS cost ~0.2 s per call on a loaded 2-core host
        with httpx.Client(timeout=timeout_s, trust_env=False, verify=False) as client:
            ctx = b""
            if auth is not None:
                status, raw, _ = _call(client, "GET", url("/health"), {**headers}, b"", end, where)
                ctx = http_context(method, endpoint_of(ip, addr.port), path, _instance(where, status, raw))
                headers[HTTP_HEADER] = auth.sign_http(ctx, content)
            status, raw, resp_headers = _call(client, method, url(path), headers, content, end, where)
    except httpx.TimeoutException as e:
        raise BootstrapUnreachable(f"{where}: no complete answer within {timeout_s}s", str(e)) from e
    except httpx.HTTPError as e:
        raise BootstrapUnreachable(f"{where} unreachable ({type(e).__name__})", str(e)) from e
    if status == 503:
        raise BootstrapNotReady(f"{where}: HTTP 503 (not every prefill rank registered yet)", _detail(raw))
    if status != 200:
        raise BootstrapError(f"{where}: HTTP {status}", _detail(raw))
    if auth is not None:
        try:
            auth.verify_reply(ctx, headers[HTTP_HEADER], raw, resp_headers.get(REPLY_HEADER))
        except AuthError as e:
            raise BootstrapError(f"{where}: {e}") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise BootstrapError(f"{where}: answer is not JSON") from e


def _call(
    client: httpx.Client,
    method: str,
    url: httpx.URL,
    headers: dict[str, str],
    content: bytes,
    end: float,
    where: str,
) -> tuple[int, bytes, httpx.Headers]:
    """Status, body (at most MAX_ANSWER_BYTES) and headers of one exchange; no read starts after `end`."""
    with client.stream(method, url, content=content, headers=headers) as resp:
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
            raise BootstrapError(f"{where}: answer of {declared} bytes (at most {MAX_ANSWER_BYTES})")
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
                raise BootstrapError(f"{where}: answer longer than {MAX_ANSWER_BYTES} bytes")
        return resp.status_code, bytes(buf), resp.headers


def _instance(where: str, status: int, raw: bytes) -> str:
    """The server's instance id from its /health answer (what a signed call names)."""
    try:
        instance = json.loads(raw)["instance"] if status == 200 else None
    except (ValueError, KeyError, TypeError):
        instance = None
    if not isinstance(instance, str) or not 0 < len(instance) <= 64:
        raise BootstrapError(f"{where}: /health names no instance (HTTP {status}; not kvpipe?)")
    return instance


def _detail(raw: bytes) -> str:
    """What a server said in an error answer, for the log (never a client's message)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode(errors="replace")
    return str(body.get("detail", body))[:500] if isinstance(body, dict) else raw[:200].decode(errors="replace")


def register_prefill_rank(
    host: str, port: int, info: PrefillRankInfo, timeout_s: float = 2.0, auth: Authenticator | None = None
) -> None:
    """Register a prefill rank with its own instance's bootstrap server (whose refusal reasons are
    its own words: they are kept in the message, unlike a decode's look-ups)."""
    try:
        _request("PUT", host, port, f"/v1/prefill/ranks/{info.rank}", timeout_s, info.to_dict(), auth)
    except BootstrapError as e:
        if e.detail:
            raise type(e)(f"{e}: {e.detail}", e.detail) from e
        raise


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
