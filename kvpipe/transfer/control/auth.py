"""Shared-secret authentication of the PD control plane and the bootstrap API.

Both servers of a PD pair are given the same token (`--disaggregation-auth-token-file`, or the
environment variable below; `--disaggregation-auth-token` works but shows in process lists).
Every control-plane frame and every bootstrap HTTP call then carries an HMAC-SHA256 tag over

    context | timestamp | nonce | payload

where `context` names the receiver: the destination ZeroMQ address, or for HTTP the method, the
endpoint the caller connected to (the IP and port: the server reads them off its accepted socket,
so a call relayed by another server, whatever Host header it carries, names the wrong one), the
path and the bootstrap server's instance id (random per start, so a captured header is refused by
every other bootstrap server and by the same port after a restart); `payload` is the encoded
message (whose fields hold the room) or the HTTP body. The
receiver checks the tag in constant time, that the timestamp is within `max_skew_s` of its own
clock, and that it has not seen the (timestamp, nonce) pair before (replays inside the window);
anything else is rejected and counted. A bootstrap answer is tagged over the request's context,
timestamp and nonce (fresh per call) and its own body (`sign_reply`), so a decode accepts only the
answer to the question it asked, from the endpoint it asked. The token itself never crosses the
wire. (Roles among the holders of one token: bootstrap.py and docs/architecture.md.)

    auth = Authenticator.from_token("a-shared-secret-of-16+-chars")
    frame = auth.seal(payload, context=b"tcp://10.0.0.2:5555")   # sender
    payload = auth.open(frame, context=b"tcp://10.0.0.2:5555")   # receiver; raises AuthError
    ctx = http_context("PUT", "10.0.0.2:8998", "/v1/prefill/ranks/0", server_instance)  # the IP connected to
    header = auth.sign_http(ctx, body)                # X-Kvpipe-Auth value
    stamp = auth.verify_http(ctx, body, header)       # server; raises AuthError
    reply = auth.sign_reply(ctx, stamp, answer)       # X-Kvpipe-Auth-Reply value
    auth.verify_reply(ctx, header, answer, reply)     # client; raises AuthError

Frame layout: MAGIC(4) | timestamp ns (8, little endian) | nonce (8) | tag (32) | payload.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from kvpipe.config import MIN_AUTH_TOKEN_CHARS

TOKEN_ENV = "KVPIPE_DISAGGREGATION_AUTH_TOKEN"
HTTP_HEADER = "X-Kvpipe-Auth"
REPLY_HEADER = "X-Kvpipe-Auth-Reply"
MAGIC = b"KVA1"
_HEAD = struct.Struct("<4sQQ")  # magic, timestamp ns, nonce
TAG_BYTES = 32
FRAME_OVERHEAD = _HEAD.size + TAG_BYTES  # bytes seal() adds in front of a payload
DEFAULT_MAX_SKEW_S = 30.0
MAX_REMEMBERED = 1 << 20  # (timestamp, nonce) pairs kept for replay detection


class AuthError(Exception):
    """A frame or request without a valid tag, outside the time window, or replayed."""


def http_context(method: str, endpoint: str, path: str, instance: str) -> bytes:
    """What a bootstrap call's tag names: `endpoint` is the "ip:port" ("[v6]:port") the caller
    connected to (bootstrap_client.endpoint_of), `instance` the bootstrap server's id (its /health
    says it)."""
    return f"{method.upper()} {endpoint.lower()}{path} instance={instance}".encode()


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def authenticator(token: str | None) -> Authenticator | None:
    """The endpoint's authenticator for a configured token; None without one."""
    return None if token is None else Authenticator.from_token(token)


def new_token() -> str:
    """A random token (for a launcher that starts both servers itself)."""
    return secrets.token_urlsafe(32)


class _ReplayWindow:
    """(timestamp, nonce) pairs seen in the last 2 * max_skew_s; thread-safe, bounded."""

    def __init__(self, horizon_ns: int, capacity: int = MAX_REMEMBERED) -> None:
        self._horizon_ns, self._capacity = horizon_ns, capacity
        self._seen: set[tuple[int, int]] = set()
        self._order: deque[tuple[int, int]] = deque()  # insertion order ~ timestamp order
        self._lock = threading.Lock()

    def first_time(self, ts_ns: int, nonce: int, now_ns: int) -> bool:
        key = (ts_ns, nonce)
        with self._lock:
            while self._order and (self._order[0][0] < now_ns - self._horizon_ns or len(self._order) >= self._capacity):
                self._seen.discard(self._order.popleft())
            if key in self._seen:
                return False
            self._seen.add(key)
            self._order.append(key)
            return True


class Authenticator:
    def __init__(
        self, key: bytes, *, max_skew_s: float = DEFAULT_MAX_SKEW_S, clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        if max_skew_s <= 0:
            raise ValueError("max_skew_s must be positive")
        self._key = key
        self._skew_ns = int(max_skew_s * 1e9)
        self._clock_ns = clock_ns
        # nonces: a random start per process, then a counter (unique per sender without a lock)
        self._nonces = itertools.count(secrets.randbits(62))
        self._window = _ReplayWindow(2 * self._skew_ns)

    @classmethod
    def from_token(cls, token: str, **kw: object) -> Authenticator:
        # a derived key: the token is never used as-is, so a tag says nothing about other uses of it
        if len(token) < MIN_AUTH_TOKEN_CHARS:
            raise ValueError(f"the disaggregation auth token needs at least {MIN_AUTH_TOKEN_CHARS} characters")
        key = hashlib.sha256(b"kvpipe-disaggregation-auth-v1\0" + token.encode()).digest()
        return cls(key, **kw)  # type: ignore[arg-type]

    def _tag(self, context: bytes, ts_ns: int, nonce: int, payload: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(struct.pack("<I", len(context)))
        mac.update(context)
        mac.update(struct.pack("<QQ", ts_ns, nonce))
        mac.update(payload)
        return mac.digest()

    def _check(self, context: bytes, ts_ns: int, nonce: int, tag: bytes, payload: bytes | memoryview) -> None:
        if not hmac.compare_digest(tag, self._tag(context, ts_ns, nonce, payload)):
            raise AuthError("bad authentication tag (wrong token, or the message was altered)")
        now = self._clock_ns()
        if abs(now - ts_ns) > self._skew_ns:
            raise AuthError(
                f"timestamp {abs(now - ts_ns) / 1e9:.1f}s away from this host's clock "
                f"(allowed {self._skew_ns / 1e9:.0f}s)"
            )
        if not self._window.first_time(ts_ns, nonce, now):
            raise AuthError("replayed message")

    # ---- control-plane frames ------------------------------------------------------------------
    def seal(self, payload: bytes, context: bytes) -> bytes:
        ts, nonce = self._clock_ns(), next(self._nonces) & ((1 << 64) - 1)
        return _HEAD.pack(MAGIC, ts, nonce) + self._tag(context, ts, nonce, payload) + payload

    def open(self, frame: bytes, context: bytes) -> memoryview:
        """The payload of a frame sealed for `context`; AuthError if anything is off."""
        start = _HEAD.size + TAG_BYTES
        if len(frame) < start or frame[:4] != MAGIC:
            raise AuthError("frame carries no authentication tag")
        _, ts, nonce = _HEAD.unpack_from(frame)
        view = memoryview(frame)
        self._check(context, ts, nonce, bytes(view[_HEAD.size : start]), view[start:])
        return view[start:]

    # ---- bootstrap HTTP ------------------------------------------------------------------------
    def sign_http(self, context: bytes, body: bytes) -> str:
        """The X-Kvpipe-Auth value of a call with `context` (http_context) and `body`."""
        ts, nonce = self._clock_ns(), next(self._nonces) & ((1 << 64) - 1)
        return _format(ts, nonce, self._tag(context, ts, nonce, body))

    def verify_http(self, context: bytes, body: bytes, header: str | None) -> tuple[int, int]:
        """Check a call's header; its (timestamp, nonce), which the answer is signed over."""
        ts, nonce, tag = _parse(header, HTTP_HEADER)
        self._check(context, ts, nonce, tag, body)
        return ts, nonce

    def sign_reply(self, context: bytes, stamp: tuple[int, int], body: bytes) -> str:
        """The X-Kvpipe-Auth-Reply value of the answer `body` to the call verify_http stamped."""
        ts, nonce = stamp
        return self._tag(_REPLY + context, ts, nonce, body).hex()

    def verify_reply(self, context: bytes, request_header: str, body: bytes, reply: str | None) -> None:
        """The answer to our call (`request_header` is what we sent) came from a token holder and
        answers this very call: no window needed, the nonce is ours and fresh."""
        ts, nonce, _ = _parse(request_header, HTTP_HEADER)
        try:
            tag = bytes.fromhex(reply or "")
        except ValueError:
            tag = b""
        if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, self._tag(_REPLY + context, ts, nonce, body)):
            raise AuthError(f"answer without a valid {REPLY_HEADER} (not from a holder of the token, or altered)")


_REPLY = b"reply\0"  # a reply's tag can never pass for a call's


def _format(ts: int, nonce: int, tag: bytes) -> str:
    return f"{ts}.{nonce}.{tag.hex()}"


def _parse(header: str | None, name: str) -> tuple[int, int, bytes]:
    if not header:
        raise AuthError(f"missing {name} header")
    try:
        ts_s, nonce_s, tag_hex = header.split(".")
        ts, nonce, tag = int(ts_s), int(nonce_s), bytes.fromhex(tag_hex)
    except ValueError:
        raise AuthError(f"malformed {name} header") from None
    if not (0 <= ts < 1 << 64 and 0 <= nonce < 1 << 64 and len(tag) == TAG_BYTES):
        raise AuthError(f"malformed {name} header")
    return ts, nonce, tag
