"""The servers' port table (kvpipe/listen_ports.py) from their flags, the range flags' refusals,
and control endpoints bound inside --disaggregation-control-ports."""

from __future__ import annotations

import socket

import pytest

from kvpipe.cli import build_parser
from kvpipe.commands.flags import server_config_from_args
from kvpipe.config import ConfigError, PortRange, ServerConfig
from kvpipe.listen_ports import (
    MOONCAKE_DEFAULT_PORTS,
    Peer,
    check_port_ranges,
    mooncake_port_env,
    mooncake_ports,
    server_listeners,
)
from kvpipe.transfer.control.endpoint import ControlEndpoint


def parse(*flags: str) -> ServerConfig:
    argv = ["serve", "--model-path", "m", *flags]
    parser, _ = build_parser(argv)
    return server_config_from_args(parser.parse_args(argv))


def table(cfg: ServerConfig, env: dict[str, str] | None = None) -> dict[str, tuple[PortRange, tuple[Peer, ...], bool]]:
    return {lst.name: (lst.ports, lst.peers, lst.pinned) for lst in server_listeners(cfg, env or {})}


PINNED = ("--disaggregation-control-ports", "17000-17015", "--disaggregation-mooncake-ports", "17100-17131")


def test_prefill_listens_on_http_bootstrap_control_and_mooncake() -> None:
    role = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "8998")
    cfg = parse("--port", "30000", *role, *PINNED)
    assert table(cfg) == {
        "http": (PortRange(30000, 30000), (Peer.ROUTER, Peer.PROMETHEUS), True),
        "bootstrap": (PortRange(8998, 8998), (Peer.PD,), True),
        "control": (PortRange(17000, 17015), (Peer.PD,), True),
        "mooncake": (PortRange(17100, 17131), (Peer.PD,), True),
    }


def test_decode_has_no_bootstrap_port_and_colocated_only_http() -> None:
    decode = table(parse("--disaggregation-mode", "decode", *PINNED))
    assert sorted(decode) == ["control", "http", "mooncake"]
    assert sorted(table(parse())) == ["http"]


def test_colocated_server_with_the_kv_tier_opens_mooncake_ports() -> None:
    cfg = parse(
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "mooncake",
        "--hicache-mooncake-master",
        "10.0.0.5:50051",
        "--disaggregation-mooncake-ports",
        "17100-17131",
    )
    assert sorted(table(cfg)) == ["http", "mooncake"]


def test_unpinned_ranges_are_ephemeral_and_mooncake_follows_its_environment() -> None:
    cfg = parse("--disaggregation-mode", "decode")
    t = table(cfg)
    assert not t["control"][2] and not t["mooncake"][2]
    assert t["mooncake"][0] == MOONCAKE_DEFAULT_PORTS
    env = {"MC_MIN_RPC_PORT": "20000", "MC_MAX_RPC_PORT": "20063"}
    assert mooncake_ports(cfg, env) == PortRange(20000, 20063)
    assert table(cfg, env)["mooncake"] == (PortRange(20000, 20063), (Peer.PD,), True)
    # the flag wins over the environment, and is what serve puts into it for Mooncake
    pinned = parse("--disaggregation-mode", "decode", *PINNED)
    assert mooncake_ports(pinned, env) == PortRange(17100, 17131)
    assert mooncake_port_env(pinned) == {"MC_MIN_RPC_PORT": "17100", "MC_MAX_RPC_PORT": "17131"}
    assert mooncake_port_env(cfg) == {}


@pytest.mark.parametrize("text", ["17000", "abc", "17010-17000", "0-10", "70000-70001", "1-2-3"])
def test_bad_port_ranges_are_refused(text: str) -> None:
    if text == "17000":  # one port is a range of one
        assert PortRange.parse(text) == PortRange(17000, 17000)
        return
    with pytest.raises(ConfigError):
        PortRange.parse(text)


def test_ranges_too_small_or_overlapping_the_fixed_ports_are_refused() -> None:
    with pytest.raises(SystemExit, match="control endpoints"):
        parse("--disaggregation-mode", "prefill", "--tp-size", "2", "--disaggregation-control-ports", "17000-17000")
    with pytest.raises(SystemExit, match="Mooncake engines"):
        parse("--disaggregation-mode", "decode", "--tp-size", "2", "--disaggregation-mooncake-ports", "17100-17102")
    with pytest.raises(SystemExit, match="inside the port range"):
        parse("--port", "17005", "--disaggregation-mode", "decode", "--disaggregation-control-ports", "17000-17015")
    check_port_ranges(parse("--disaggregation-mode", "prefill", "--tp-size", "2", *PINNED))


def free_range(n: int) -> PortRange:
    """`n` consecutive ports free right now on loopback (probed: bound and released)."""
    for first in range(41000, 48000, n):
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return PortRange(first, first + n - 1)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range")


def test_control_endpoints_bind_inside_the_range_and_say_when_it_is_full() -> None:
    r = free_range(2)
    eps = [ControlEndpoint("127.0.0.1", lambda m: None, ports=r) for _ in range(2)]
    try:
        ports = sorted(int(ep.address.rsplit(":", 1)[1]) for ep in eps)
        assert ports == [r.first, r.last]
        with pytest.raises(ConfigError, match="no free port"):
            ControlEndpoint("127.0.0.1", lambda m: None, ports=r)
    finally:
        for ep in eps:
            ep.close()

    again = ControlEndpoint("127.0.0.1", lambda m: None, ports=r)
    again.close()
