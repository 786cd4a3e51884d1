"""Shared-secret authentication on loopback: control endpoints with the deployment token accept
each other and drop forged, unsigned and replayed frames; a bootstrap server with a token rejects
forged registrations and look-ups."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.auth import HTTP_HEADER, Authenticator, http_context
from kvpipe.transfer.control.bootstrap import BootstrapError, BootstrapServer, fetch_prefill_info, register_prefill_rank
from kvpipe.transfer.control.endpoint import ControlEndpoint
from tests.helpers.bootstrap_info import rank_info

TOKEN = "correct-horse-battery-staple"


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
        ctx = http_context("PUT", f"127.0.0.1:{srv.port}", "/v1/prefill/ranks/0", srv.instance)
        header = auth.sign_http(ctx, body)
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
