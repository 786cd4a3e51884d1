"""`kvpipe launch --firewall`'s bookkeeping without a firewall (kvpipe/launch/firewall.py): the
protected port ranges, the nftables script and the iptables-restore input, what each backend runs
(recorded: iptables is not installed on every test host), and which stale tables go. The rules
themselves are tried in network namespaces: tests/integration/test_launch_firewall.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpipe.config import ConfigError
from kvpipe.launch.firewall import (
    MC_RANGE_CEIL,
    MC_RANGE_FLOOR,
    MC_RANGE_SIZE,
    Firewall,
    FirewallError,
    FirewallSpec,
    Rules,
    mooncake_range,
    port_ranges,
    remove_stale,
)


class Recorder:
    """Runs nothing: records each command and answers from `answers` (argv[:2] -> stdout)."""

    def __init__(self, answers: dict[tuple[str, ...], str] | None = None, fail: set[str] | None = None) -> None:
        self.calls: list[tuple[list[str], str | None]] = []
        self.answers, self.fail = answers or {}, fail or set()

    def __call__(self, argv: Sequence[str], stdin: str | None) -> str:
        self.calls.append((list(argv), stdin))
        if " ".join(argv[:2]) in self.fail:
            raise FirewallError("no such rule")
        return self.answers.get(tuple(argv[:2]), "")


def test_ports_merge_into_ranges() -> None:
    assert port_ranges([8998, (21000, 21127), 21128, 5, 21050, 7, 6]) == ((5, 7), (8998, 8998), (21000, 21128))
    assert port_ranges([]) == ()


def test_the_mooncake_range_is_free_below_the_ephemeral_ports_or_the_environment_s() -> None:
    lo, hi = mooncake_range({})
    assert MC_RANGE_FLOOR <= lo and hi < MC_RANGE_CEIL and hi - lo + 1 == MC_RANGE_SIZE
    assert mooncake_range({"MC_MIN_RPC_PORT": "15000", "MC_MAX_RPC_PORT": "15100"}) == (15000, 15100)


def test_the_nft_script_replaces_the_table_whole() -> None:
    rules = Rules("kvpipe_42_8000", ((8998, 8998), (21000, 21127)), ("10.0.0.0/8", "2001:db8::/32"))
    script = rules.nft_script()
    assert script.startswith("table inet kvpipe_42_8000 {}\ndelete table inet kvpipe_42_8000\n")
    assert "elements = { 8998, 21000-21127 }" in script
    lines = [line.strip() for line in script.splitlines()]
    order = ["tcp dport != @ports accept", "fib saddr type local accept", "ip saddr 10.0.0.0/8 accept"]
    order += ["ip6 saddr 2001:db8::/32 accept", "reject with tcp reset"]
    assert [lines.index(x) for x in order] == sorted(lines.index(x) for x in order)


def test_iptables_input_chunks_multiport_and_keeps_the_families_apart() -> None:
    rules = Rules("kvpipe_42_8000", tuple((p, p) for p in range(100, 110)), ("10.0.0.0/8", "2001:db8::/32"))
    v4, v6 = rules.iptables_restore(4), rules.iptables_restore(6)
    assert ":KVPIPE_42_8000 - [0:0]" in v4 and v4.rstrip().endswith("COMMIT")
    rejects = [line for line in v4.splitlines() if "REJECT" in line]
    assert len(rejects) == 2 and rejects[0].count(",") == 6  # 7 ports a rule: under multiport's 15
    assert "-s 10.0.0.0/8" in v4 and "2001:db8" not in v4 and "-s 2001:db8::/32" in v6


def test_each_backend_makes_and_removes_its_table() -> None:
    nft = Recorder()
    fw = Firewall("kvpipe_42_8000", (), "nft", nft)
    fw.close()
    assert nft.calls == []  # nothing made, nothing removed
    fw.apply([(21000, 21127), 8998])
    fw.close()
    assert [c[0] for c in nft.calls] == [["nft", "-f", "-"], ["nft", "delete", "table", "inet", "kvpipe_42_8000"]]
    ipt = Recorder(fail={"iptables -C", "ip6tables -C"})  # the jump is not there yet
    Firewall("kvpipe_42_8000", (), "iptables", ipt).apply([8998])
    made = [c[0][:2] for c in ipt.calls]
    assert made == [["iptables-restore", "--noflush"], ["iptables", "-C"], ["iptables", "-I"]] + [
        ["ip6tables-restore", "--noflush"],
        ["ip6tables", "-C"],
        ["ip6tables", "-I"],
    ]


def test_only_dead_launchers_tables_go() -> None:
    listing = "table inet kvpipe_100_8000\ntable inet kvpipe_200_9000\ntable inet other\n"
    nft = Recorder({("nft", "list"): listing})
    assert remove_stale("nft", lambda pid: pid == 200, nft) == ["kvpipe_100_8000"]
    assert nft.calls[-1][0] == ["nft", "delete", "table", "inet", "kvpipe_100_8000"]
    ipt = Recorder({("iptables", "-S"): "-P INPUT ACCEPT\n-N KVPIPE_100_8000\n-N DOCKER\n"})
    assert remove_stale("iptables", lambda pid: False, ipt) == ["kvpipe_100_8000"]


def test_allowed_networks_are_checked() -> None:
    with pytest.raises(ConfigError, match="--firewall-allow"):
        FirewallSpec(("10.0.0.0/33",))
    assert FirewallSpec(("10.1.2.3", "fd00::/8")).allow == ("10.1.2.3", "fd00::/8")
