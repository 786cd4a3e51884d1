"""Link faults as data: the `--link-fault` syntax, labels, and the nftables / netem commands they
become (no root needed; tests/integration/test_link_faults.py applies them)."""

from __future__ import annotations

import pytest

from kvpipe.harness.link_faults import (
    TABLE,
    FaultKind,
    LinkFault,
    drop_rule,
    netem_args,
    netem_commands,
    nft_commands,
)
from kvpipe.harness.testbed import make_spec, setup_commands


def test_parse_every_kind() -> None:
    assert LinkFault.parse("loss:0.1%:30s") == LinkFault(FaultKind.LOSS, 30.0, loss_pct=0.1)
    assert LinkFault.parse("partition:6s") == LinkFault(FaultKind.PARTITION, 6.0)
    assert LinkFault.parse("flap:1s/2.5s:20s") == LinkFault(FaultKind.FLAP, 20.0, down_s=1.0, up_s=2.5)
    assert LinkFault.parse("delay:50ms:10s") == LinkFault(FaultKind.DELAY, 10.0, delay_ms=50.0)
    assert LinkFault.parse("JITTER:50ms/10ms:10s") == LinkFault(FaultKind.JITTER, 10.0, delay_ms=50, jitter_ms=10)
    assert LinkFault.parse("reorder:25%/10ms:5s") == LinkFault(FaultKind.REORDER, 5.0, reorder_pct=25, delay_ms=10)
    assert [LinkFault.parse(t).label for t in ("loss:1%:30s", "partition:6s", "flap:1s/2s:20s")] == [
        "loss 1% 30 s",
        "partition 6 s",
        "flap 1/2 s 20 s",
    ]
    assert {k.netem for k in FaultKind} == {True, False}
    assert [k for k in FaultKind if k.netem] == [FaultKind.DELAY, FaultKind.JITTER, FaultKind.REORDER]


@pytest.mark.parametrize(
    "bad,match",
    [
        ("outage:5s", "unknown link fault"),
        ("loss:1:30s", "bad link fault"),
        ("partition:6", "bad link fault"),
        ("loss:0%:5s", "loss must be"),
        ("loss:150%:5s", "loss must be"),
        ("partition:0s", "positive time"),
        ("flap:0s/1s:5s", "positive down and up"),
        ("reorder:100%/5ms:5s", "reorder must be"),
        ("delay:0ms:5s", "positive delay"),
    ],
)
def test_bad_faults_are_refused_with_the_syntax(bad: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinkFault.parse(bad)


def test_commands() -> None:
    spec = make_spec("8mbit")
    assert drop_rule("v", None) == 'iifname "v" drop'
    assert drop_rule("v", 0.1) == 'iifname "v" numgen random mod 10000 < 10 drop'  # 10 in 10,000
    assert drop_rule("v", 5) == 'iifname "v" numgen random mod 10000 < 500 drop'
    add = nft_commands(spec, drop_rule("{veth}", 1.0))
    assert [c[3] for c in add] == [spec.ns_a, spec.ns_b]  # ip netns exec NS nft ...
    assert f'iifname "{spec.veth_a}"' in add[0][-1] and f'iifname "{spec.veth_b}"' in add[1][-1]
    assert all(c[-1].startswith(f"add table inet {TABLE}; flush table inet {TABLE};") for c in add)
    assert [c[-3:] for c in nft_commands(spec, None)] == [["delete", "table", "inet", TABLE][-3:]] * 2
    jitter = LinkFault.parse("jitter:40ms/10ms:5s")
    assert netem_args(jitter) == ["delay", "40ms", "10ms"]
    assert netem_args(LinkFault.parse("reorder:25%/10ms:5s")) == ["delay", "10ms", "reorder", "25%", "50%"]
    on = netem_commands(spec, jitter)
    assert all(c[c.index("parent") + 1] == "1:1" for c in on)  # under the tbf, whose handle is 1:
    assert ["root", "handle", "1:", "tbf"] == next(c for c in setup_commands(spec) if "tbf" in c)[-10:-6]
    assert [c[4] for c in netem_commands(spec, None)] == ["del", "del"]
