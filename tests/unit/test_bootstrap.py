"""Bootstrap server: register / fetch / restart, client errors, compatibility checks."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from kvpipe.transfer.control.bootstrap import (
    BootstrapError,
    BootstrapNotReady,
    BootstrapServer,
    BootstrapUnreachable,
    DecodeInfo,
    IncompatiblePeerError,
    PrefillInstanceInfo,
    PrefillRankInfo,
    check_compatible,
    fetch_prefill_info,
    fetch_prefill_rank,
    register_prefill_rank,
    wait_prefill_info,
)
from kvpipe.transfer.planning.layout import KVLayout


def layout(kv_heads=2, head_start=0, total=2, layers=2, page_size=4, dtype="float32", base=1 << 20) -> KVLayout:
    page = kv_heads * page_size * 8 * 4
    return KVLayout(
        num_layers=layers,
        page_size=page_size,
        kv_heads=kv_heads,
        head_start=head_start,
        total_kv_heads=total,
        head_dim=8,
        dtype=dtype,
        itemsize=4,
        buffer_addrs=tuple(base + i * (1 << 16) for i in range(2 * layers)),
        buffer_nbytes=16 * page,
    )


def rank_info(rank=0, tp=1, instance="inst-a", model="m", **kw) -> PrefillRankInfo:
    heads = 2 // tp
    return PrefillRankInfo(
        rank=rank,
        tp_size=tp,
        layout=layout(kv_heads=heads, head_start=rank * heads, **kw),
        data_address=f"127.0.0.1:{17000 + rank}",
        control_address=f"tcp://127.0.0.1:{18000 + rank}",
        model_name=model,
        instance_id=instance,
    )


@pytest.fixture(scope="module")
def server():
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


def test_register_and_fetch_all_ranks(server):
    port = server.port
    register_prefill_rank("127.0.0.1", port, rank_info(1, tp=2))
    with pytest.raises(BootstrapNotReady, match="1/2 ranks"):
        fetch_prefill_info("127.0.0.1", port)
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
    import httpx

    r = httpx.put(f"{server.url}/v1/prefill/ranks/0", json={"rank": 0}, trust_env=False)
    assert r.status_code == 400 and "malformed" in r.json()["detail"]
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unreachable_server_gives_clear_error_within_deadline():
    port = _dead_port()
    with pytest.raises(BootstrapUnreachable, match=f"127.0.0.1:{port}.*unreachable"):
        fetch_prefill_info("127.0.0.1", port, timeout_s=0.5)
    with pytest.raises(BootstrapUnreachable):
        wait_prefill_info("127.0.0.1", port, timeout_s=0.3, retry_s=0.05)


def test_wait_retries_until_the_prefill_registers():
    with BootstrapServer("127.0.0.1", 0) as srv:
        with pytest.raises(BootstrapNotReady, match="no prefill rank"):
            wait_prefill_info("127.0.0.1", srv.port, timeout_s=0.2)
        register_prefill_rank("127.0.0.1", srv.port, rank_info(0))
        assert wait_prefill_info("127.0.0.1", srv.port, timeout_s=2.0).ranks[0].rank == 0
    with pytest.raises(BootstrapUnreachable):  # closed server frees its port
        fetch_prefill_info("127.0.0.1", srv.port, timeout_s=0.5)


def instance(tp=1, **kw) -> PrefillInstanceInfo:
    return PrefillInstanceInfo("inst", tp, kw.get("model", "m"), tuple(rank_info(r, tp=tp, **kw) for r in range(tp)))


def test_check_compatible_accepts_heterogeneous_tp():
    check_compatible(instance(tp=1), DecodeInfo("m", 1, (layout(),)))
    check_compatible(instance(tp=2), DecodeInfo("m", 1, (layout(),)))
    check_compatible(instance(tp=1), DecodeInfo("m", 2, (layout(1, 0), layout(1, 1))))


@pytest.mark.parametrize(
    "decode, match",
    [
        (DecodeInfo("other", 1, (layout(),)), "model 'm'.*'other'"),
        (DecodeInfo("m", 1, (layout(page_size=8),)), "page size mismatch: 4 here vs 8"),
        (DecodeInfo("m", 1, (layout(dtype="bfloat16"),)), "KV dtype mismatch"),
        (DecodeInfo("m", 1, (layout(layers=3),)), "number of layers mismatch"),
        (DecodeInfo("m", 2, (layout(),)), "tp_size 2 but 1 layouts"),
    ],
)
def test_check_compatible_refuses_mismatches(decode, match):
    with pytest.raises(IncompatiblePeerError, match=match):
        check_compatible(instance(tp=1), decode)


def test_check_compatible_refuses_indivisible_tp():
    three = tuple(layout(kv_heads=2, total=6, head_start=2 * r) for r in range(3))
    prefill = PrefillInstanceInfo(
        "inst",
        2,
        "m",
        tuple(
            dataclasses.replace(rank_info(r, tp=2), layout=layout(kv_heads=3, total=6, head_start=3 * r))
            for r in range(2)
        ),
    )
    with pytest.raises(IncompatiblePeerError, match="one must divide the other"):
        check_compatible(prefill, DecodeInfo("m", 3, three))


def test_check_compatible_refuses_wrong_head_ranges():
    with pytest.raises(IncompatiblePeerError, match=r"decode rank 1 holds KV heads \[0, 1\), TP 2 needs \[1, 2\)"):
        check_compatible(instance(tp=1), DecodeInfo("m", 2, (layout(1, 0), layout(1, 0))))
