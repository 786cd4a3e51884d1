"""Bootstrap client errors (no server reachable) and compatibility checks; the server itself on
loopback: tests/integration/test_bootstrap_server.py."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from kvpipe.transfer.control.bootstrap import (
    BootstrapUnreachable,
    DecodeInfo,
    IncompatiblePeerError,
    PrefillInstanceInfo,
    check_compatible,
    fetch_prefill_info,
    wait_prefill_info,
)
from tests.helpers.bootstrap_info import layout, rank_info


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


def instance(tp=1, **kw) -> PrefillInstanceInfo:
    return PrefillInstanceInfo("inst", tp, kw.get("model", "m"), tuple(rank_info(r, tp=tp, **kw) for r in range(tp)))


def test_check_compatible_accepts_heterogeneous_tp():
    check_compatible(instance(tp=1), DecodeInfo("m", 1, (layout(),)))
    check_compatible(instance(tp=2), DecodeInfo("m", 1, (layout(),)))
    check_compatible(instance(tp=1), DecodeInfo("m", 2, (layout(1, 0), layout(1, 1))))


@pytest.mark.parametrize(
    "decode, match",
    [
        (DecodeInfo("other", 1, (layout(),)), "served model name: prefill 'm', decode 'other'"),
        (DecodeInfo("m", 1, (layout(page_size=8),)), "page size mismatch: 4 on the prefill vs 8 on the decode"),
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
