"""Shared-secret authentication (transfer/control/auth.py) of control frames, bootstrap calls, and the
control endpoint and bootstrap server that use it."""

from __future__ import annotations

import time

import httpx
import msgpack
import pytest
import zmq
from test_bootstrap import rank_info

from kvpipe.config import ConfigError, DisaggregationConfig
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import HTTP_HEADER, Authenticator, AuthError
from kvpipe.transfer.control.bootstrap import BootstrapError, BootstrapServer, fetch_prefill_info, register_prefill_rank
from kvpipe.transfer.control.endpoint import ControlEndpoint

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


def test_http_tags_bind_method_path_and_body() -> None:
    a, b = Authenticator.from_token(TOKEN), Authenticator.from_token(TOKEN)
    header = a.sign_http("PUT", "/v1/prefill/ranks/0", b'{"rank": 0}')
    b.verify_http("PUT", "/v1/prefill/ranks/0", b'{"rank": 0}', header)
    with pytest.raises(AuthError, match="replayed"):
        b.verify_http("PUT", "/v1/prefill/ranks/0", b'{"rank": 0}', header)
    for method, path, body in (
        ("PUT", "/v1/prefill/ranks/1", b'{"rank": 0}'),
        ("GET", "/v1/prefill/ranks/0", b""),
        ("PUT", "/v1/prefill/ranks/0", b'{"rank": 1}'),
    ):
        with pytest.raises(AuthError, match="tag"):
            b.verify_http(method, path, body, a.sign_http("PUT", "/v1/prefill/ranks/0", b'{"rank": 0}'))
    for bad in (None, "", "1.2", "x.y.z", "1.2.zz", f"1.2.{'00' * 31}", f"-1.2.{'00' * 32}"):
        with pytest.raises(AuthError, match="header"):
            b.verify_http("GET", "/", b"", bad)


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="16 characters"):
        DisaggregationConfig(mode="prefill", auth_token="short")
    with pytest.raises(ValueError, match="16 characters"):
        Authenticator.from_token("short")
    assert TOKEN not in repr(DisaggregationConfig(mode="prefill", auth_token=TOKEN))


def _wait(pred, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_endpoints_with_a_token_accept_each_other_and_drop_forgeries() -> None:
    got: list[object] = []
    receiver = ControlEndpoint("127.0.0.1", got.append, name="rx", auth=Authenticator.from_token(TOKEN)).start()
    sender = ControlEndpoint("127.0.0.1", lambda msg: None, name="tx", auth=Authenticator.from_token(TOKEN)).start()
    intruder = ControlEndpoint(
        "127.0.0.1", lambda msg: None, name="evil", auth=Authenticator.from_token("not-the-deployment-token")
    ).start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 1000)
    try:
        assert sender.send(receiver.address, m.Heartbeat("tx", 1))
        _wait(lambda: len(got) == 1)
        assert got == [m.Heartbeat("tx", 1)]
        intruder.send(receiver.address, m.Abort(7, "evil", m.Side.PREFILL, "forged"))
        raw.connect(receiver.address)
        captured = Authenticator.from_token(TOKEN).seal(m.encode(m.Heartbeat("tx", 2)), receiver.address.encode())
        for frame in (m.encode(m.Abort(7, "evil", m.Side.DECODE, "unsigned")), captured, captured):
            raw.send(frame)
        _wait(lambda: receiver.stats.auth_rejected == 3)  # wrong token, unsigned, the replay
        assert got == [m.Heartbeat("tx", 1), m.Heartbeat("tx", 2)]
        assert receiver.stats.malformed == 0 and receiver.stats.handler_errors == 0
        assert sender.send(receiver.address, m.Heartbeat("tx", 3))  # still serving
        _wait(lambda: len(got) == 3)
    finally:
        raw.close()
        ctx.term()
        for ep in (receiver, sender, intruder):
            ep.close()


def test_bootstrap_with_a_token_rejects_forged_registrations_and_lookups() -> None:
    auth = Authenticator.from_token(TOKEN)
    with BootstrapServer("127.0.0.1", 0, auth=Authenticator.from_token(TOKEN)) as srv:
        register_prefill_rank("127.0.0.1", srv.port, rank_info(0), auth=auth)
        assert fetch_prefill_info("127.0.0.1", srv.port, auth=auth).instance_id == rank_info(0).instance_id
        forged = rank_info(0, instance="attacker")
        with pytest.raises(BootstrapError, match="401"):  # no tag
            register_prefill_rank("127.0.0.1", srv.port, forged)
        with pytest.raises(BootstrapError, match="401"):  # the wrong token
            register_prefill_rank("127.0.0.1", srv.port, forged, auth=Authenticator.from_token("x" * 16))
        with pytest.raises(BootstrapError, match="401"):  # look-ups hand out buffer addresses
            fetch_prefill_info("127.0.0.1", srv.port)
        # a captured tag does not carry over to another body, nor work twice
        body = httpx.Request("PUT", srv.url, json=rank_info(0).to_dict()).content
        header = auth.sign_http("PUT", "/v1/prefill/ranks/0", body)
        forged_body = httpx.Request("PUT", srv.url, json=forged.to_dict()).content
        statuses = [
            httpx.put(
                srv.url + "/v1/prefill/ranks/0",
                content=content,
                headers={HTTP_HEADER: header, "Content-Type": "application/json"},
            ).status_code
            for content in (forged_body, body, body)
        ]
        assert statuses == [401, 200, 401]
        assert srv.auth_rejected == 5
        assert httpx.get(srv.url + "/health").status_code == 200  # open: a liveness probe
        assert fetch_prefill_info("127.0.0.1", srv.port, auth=auth).instance_id == rank_info(0).instance_id
