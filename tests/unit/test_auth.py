"""Shared-secret authentication (transfer/control/auth.py) of control frames and bootstrap calls;
the control endpoint and bootstrap server that use it: tests/integration/test_auth_endpoints.py."""

from __future__ import annotations

import msgpack
import pytest

from kvpipe.config import ConfigError, DisaggregationConfig
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import Authenticator, AuthError, http_context

TOKEN = "correct-horse-battery-staple"
CTX = b"tcp://127.0.0.1:5555"


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.ns


def test_sealed_frames_open_once_and_only_with_the_same_token_and_context() -> None:
    a, b = Authenticator.from_token(TOKEN), Authenticator.from_token(TOKEN)
    frame = a.seal(b"payload", CTX)
    assert bytes(b.open(frame, CTX)) == b"payload"
    with pytest.raises(AuthError, match="replayed"):
        b.open(frame, CTX)
    with pytest.raises(AuthError, match="tag"):
        Authenticator.from_token("another-token-of-16-chars").open(a.seal(b"x", CTX), CTX)
    with pytest.raises(AuthError, match="tag"):  # sealed for another endpoint
        b.open(a.seal(b"x", b"tcp://127.0.0.1:6666"), CTX)
    altered = bytearray(a.seal(b"room=7", CTX))
    altered[-1] ^= 1
    with pytest.raises(AuthError, match="tag"):
        b.open(bytes(altered), CTX)
    for junk in (b"", b"KVA1", msgpack.packb({"kind": "abort"}), m.encode(m.Heartbeat("s", 1))):
        with pytest.raises(AuthError, match="no authentication tag"):
            b.open(junk, CTX)


def test_stale_and_future_timestamps_are_rejected() -> None:
    clock = FakeClock()
    sender, receiver = (Authenticator.from_token(TOKEN, max_skew_s=30.0, clock_ns=clock) for _ in range(2))
    old = sender.seal(b"x", CTX)
    clock.ns += 31 * 10**9
    with pytest.raises(AuthError, match="timestamp"):
        receiver.open(old, CTX)
    future = sender.seal(b"y", CTX)
    clock.ns -= 62 * 10**9
    with pytest.raises(AuthError, match="timestamp"):
        receiver.open(future, CTX)
    clock.ns += 40 * 10**9  # 22 s before the frame's time
    assert bytes(receiver.open(future, CTX)) == b"y"  # within the window again


def test_the_replay_window_forgets_only_what_the_clock_rejects_anyway() -> None:
    clock = FakeClock()
    sender = Authenticator.from_token(TOKEN, max_skew_s=1.0, clock_ns=clock)
    receiver = Authenticator.from_token(TOKEN, max_skew_s=1.0, clock_ns=clock)
    frames = [sender.seal(b"%d" % i, CTX) for i in range(100)]
    for f in frames:
        receiver.open(f, CTX)
    clock.ns += 3 * 10**9  # past 2 * skew: forgotten, and stale
    for f in frames[:3]:
        with pytest.raises(AuthError, match="timestamp"):
            receiver.open(f, CTX)


def test_http_tags_bind_method_destination_path_instance_and_body() -> None:
    a, b = Authenticator.from_token(TOKEN), Authenticator.from_token(TOKEN)
    ctx = http_context("PUT", "10.0.0.2:8998", "/v1/prefill/ranks/0", "inst-1")
    header = a.sign_http(ctx, b'{"rank": 0}')
    b.verify_http(ctx, b'{"rank": 0}', header)
    with pytest.raises(AuthError, match="replayed"):
        b.verify_http(ctx, b'{"rank": 0}', header)
    for other, body in (
        (http_context("PUT", "10.0.0.2:8998", "/v1/prefill/ranks/1", "inst-1"), b'{"rank": 0}'),
        (http_context("GET", "10.0.0.2:8998", "/v1/prefill/ranks/0", "inst-1"), b""),
        (ctx, b'{"rank": 1}'),
        (http_context("PUT", "10.0.0.3:8998", "/v1/prefill/ranks/0", "inst-1"), b'{"rank": 0}'),  # another host
        (http_context("PUT", "10.0.0.2:8999", "/v1/prefill/ranks/0", "inst-1"), b'{"rank": 0}'),  # another port
        (http_context("PUT", "10.0.0.2:8998", "/v1/prefill/ranks/0", "inst-2"), b'{"rank": 0}'),  # restarted
    ):
        with pytest.raises(AuthError, match="tag"):
            b.verify_http(other, body, a.sign_http(ctx, b'{"rank": 0}'))
    for bad in (None, "", "1.2", "x.y.z", "1.2.zz", f"1.2.{'00' * 31}", f"-1.2.{'00' * 32}"):
        with pytest.raises(AuthError, match="header"):
            b.verify_http(ctx, b"", bad)


def test_replies_answer_one_call_only() -> None:
    client, server = Authenticator.from_token(TOKEN), Authenticator.from_token(TOKEN)
    ctx = http_context("GET", "127.0.0.1:8998", "/v1/prefill/ranks", "inst-1")
    call = client.sign_http(ctx, b"")
    reply = server.sign_reply(ctx, server.verify_http(ctx, b"", call), b'{"ranks": []}')
    client.verify_reply(ctx, call, b'{"ranks": []}', reply)
    other_call = client.sign_http(ctx, b"")  # a fresh nonce: yesterday's answer does not fit it
    outsider = Authenticator.from_token("not-the-deployment-token")
    for req, body, tag in (
        (other_call, b'{"ranks": []}', reply),
        (call, b'{"ranks": [1]}', reply),  # altered on the way
        (call, b'{"ranks": []}', outsider.sign_reply(ctx, server.verify_http(ctx, b"", other_call), b"")),
        (call, b'{"ranks": []}', None),
        (call, b'{"ranks": []}', "zz"),
    ):
        with pytest.raises(AuthError, match="Reply"):
            client.verify_reply(ctx, req, body, tag)
    with pytest.raises(AuthError, match="tag"):  # a reply's tag never passes for a call's
        server.verify_http(ctx, b'{"ranks": []}', call.rsplit(".", 1)[0] + "." + reply)


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="16 characters"):
        DisaggregationConfig(mode="prefill", auth_token="short")
    with pytest.raises(ValueError, match="16 characters"):
        Authenticator.from_token("short")
    assert TOKEN not in repr(DisaggregationConfig(mode="prefill", auth_token=TOKEN))
