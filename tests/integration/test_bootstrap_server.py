"""The bootstrap server on loopback: register / fetch / restart, bad registrations refused, a
decode's wait until the prefill registers."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from kvpipe.transfer.control.auth import Authenticator
from kvpipe.transfer.control.bootstrap import (
    BootstrapError,
    BootstrapNotReady,
    BootstrapServer,
    BootstrapUnreachable,
    fetch_prefill_info,
    fetch_prefill_rank,
    register_prefill_rank,
    report_refusal,
    wait_prefill_info,
)
from kvpipe.transfer.control.handshake import REFUSED, Handshake, RefusalNotice
from tests.helpers.bootstrap_info import layout, rank_info


@pytest.fixture(scope="module")
def server():
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def test_register_and_fetch_all_ranks(server):
    port = server.port
    register_prefill_rank("127.0.0.1", port, rank_info(1, tp=2))
    with pytest.raises(BootstrapNotReady, match="HTTP 503") as e:
        fetch_prefill_info("127.0.0.1", port)
    assert "1/2 ranks" in e.value.detail and "1/2" not in str(e.value)  # the server's words: for the log only
    register_prefill_rank("127.0.0.1", port, rank_info(0, tp=2))
    inst = fetch_prefill_info("127.0.0.1", port)
    assert inst.instance_id == "inst-a" and inst.tp_size == 2 and inst.model_name == "m"
    assert [r.rank for r in inst.ranks] == [0, 1]
    assert inst.ranks[1] == rank_info(1, tp=2)  # layout and addresses survive the round trip
    assert fetch_prefill_rank("127.0.0.1", port, 1) == rank_info(1, tp=2)
    with pytest.raises(BootstrapError, match="HTTP 404"):
        fetch_prefill_rank("127.0.0.1", port, 5)

    # A restarted prefill (new instance id) replaces the old registrations.
    register_prefill_rank("127.0.0.1", port, rank_info(0, tp=1, instance="inst-b"))
    inst = fetch_prefill_info("127.0.0.1", port)
    assert inst.instance_id == "inst-b" and inst.tp_size == 1 and len(inst.ranks) == 1


def test_bad_registrations_are_refused(server):
    port = server.port
    register_prefill_rank("127.0.0.1", port, rank_info(0, tp=2, instance="inst-c"))
    with pytest.raises(BootstrapError, match="HTTP 409"):  # same instance, other model
        register_prefill_rank("127.0.0.1", port, rank_info(1, tp=2, instance="inst-c", model="other"))
    bad = dataclasses.replace(rank_info(0, tp=1, instance="inst-c"), rank=3)
    with pytest.raises(BootstrapError, match="HTTP 400"):
        register_prefill_rank("127.0.0.1", port, bad)
    r = httpx.put(f"{server.url}/v1/prefill/ranks/0", json={"rank": 0}, trust_env=False)
    assert r.status_code == 400 and "malformed" in r.json()["detail"]
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200


def test_wait_retries_until_the_prefill_registers():
    with BootstrapServer("127.0.0.1", 0) as srv:
        with pytest.raises(BootstrapNotReady) as e:
            wait_prefill_info("127.0.0.1", srv.port, timeout_s=0.2)
        assert "no prefill rank" in e.value.detail
        register_prefill_rank("127.0.0.1", srv.port, rank_info(0))
        assert wait_prefill_info("127.0.0.1", srv.port, timeout_s=2.0).ranks[0].rank == 0
    with pytest.raises(BootstrapUnreachable):  # closed server frees its port
        fetch_prefill_info("127.0.0.1", srv.port, timeout_s=0.5)


def test_handshakes_travel_and_ranks_must_agree_on_theirs(server):
    port = server.port
    mine = Handshake.of("f" * 64, layout(1, 0), state=None)
    register_prefill_rank("127.0.0.1", port, dataclasses.replace(rank_info(0, tp=2, instance="inst-h"), handshake=mine))
    other = dataclasses.replace(mine, page_size=8)
    with pytest.raises(BootstrapError, match="HTTP 409.*another handshake"):
        register_prefill_rank(
            "127.0.0.1", port, dataclasses.replace(rank_info(1, tp=2, instance="inst-h"), handshake=other)
        )
    register_prefill_rank("127.0.0.1", port, dataclasses.replace(rank_info(1, tp=2, instance="inst-h"), handshake=mine))
    assert fetch_prefill_info("127.0.0.1", port).handshake == mine


def test_refusal_notices_reach_the_prefill_authenticated():
    got: list[RefusalNotice] = []
    auth = Authenticator.from_token("handshake-test-token")
    notice = RefusalNotice((5, 6), f"{REFUSED}: page size: prefill 16, decode 64", "page_size", None)
    with BootstrapServer("127.0.0.1", 0, auth, on_refusal=got.append) as srv:
        report_refusal("127.0.0.1", srv.port, notice, auth=auth)
        assert got == [notice]
        with pytest.raises(BootstrapError, match="HTTP 401"):  # without the token: refused and counted
            report_refusal("127.0.0.1", srv.port, notice)
        assert srv.auth_rejected == 1
        with pytest.raises(BootstrapError, match="HTTP 400$") as e:
            report_refusal("127.0.0.1", srv.port, dataclasses.replace(notice, label="not a label"), auth=auth)
        assert "malformed refusal notice" in e.value.detail
    assert got == [notice]
