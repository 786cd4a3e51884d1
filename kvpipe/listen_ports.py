"""The ports a kvpipe server listens on, read from its config alone (pure: no sockets, no env
read behind the caller's back). One table for everything that must name them: the Kubernetes
NetworkPolicies in deploy/k8s (tests/unit/test_k8s_manifests.py holds them to it), a host's
firewall, and the addresses an admin reads in /server_info.

    for lst in server_listeners(cfg, os.environ):
        print(lst.name, lst.ports, [p.value for p in lst.peers])

A server opens: its HTTP port (the API: the router; /metrics: Prometheus), a prefill its bootstrap
port, a PD server its ZeroMQ control endpoints (--disaggregation-control-ports) and Mooncake's
handshake and TCP data ports (--disaggregation-mooncake-ports), which the KV tier's store client
shares. Without the two range flags those ports are ephemeral (`Listener.pinned` False): only
loopback or an open network suits them.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpipe.config import ConfigError, PortRange, ServerConfig

# Mooncake's Transfer Engine binds its handshake (RPC) port and its TCP data port from this range
# (checked with mooncake-transfer-engine 0.3.13: both listeners of every engine, the KV tier's
# store client's too); its default when the variables are unset is MOONCAKE_DEFAULT_PORTS.
MC_MIN_PORT_ENV, MC_MAX_PORT_ENV = "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"
MOONCAKE_DEFAULT_PORTS = PortRange(15000, 17000)
MOONCAKE_PORTS_PER_ENGINE = 2  # its handshake port and its TCP data port
ANY_PORT = PortRange(1024, 65535)  # an ephemeral control endpoint: any free port


class Peer(enum.Enum):
    """Who connects to a listener."""

    CLIENTS = "clients"  # anyone: the router's API (clients send its API key)
    ROUTER = "router"  # sglang-router: the HTTP API
    PROMETHEUS = "prometheus"  # scrapes /metrics on the HTTP port
    PD = "pd"  # the deployment's other prefill and decode servers (KV, control, bootstrap, KV tier)


@dataclass(frozen=True)
class Listener:
    name: str  # http, bootstrap, control, mooncake
    ports: PortRange
    peers: tuple[Peer, ...]
    pinned: bool = True  # False: ephemeral ports (no flag fixed them), not for a firewall rule


def uses_mooncake(cfg: ServerConfig) -> bool:
    """The server runs Mooncake Transfer Engines: a PD server on the mooncake backend, or any server
    with the KV tier on a Mooncake Store."""
    d = cfg.disaggregation
    return (d.enabled and d.transfer_backend == "mooncake") or cfg.hicache.enabled


def mooncake_ports(cfg: ServerConfig, env: Mapping[str, str]) -> PortRange:
    """Where this server's Mooncake engines listen: --disaggregation-mooncake-ports, else the
    range `env` gives Mooncake, else Mooncake's default."""
    if cfg.disaggregation.mooncake_ports is not None:
        return cfg.disaggregation.mooncake_ports
    lo, hi = env.get(MC_MIN_PORT_ENV), env.get(MC_MAX_PORT_ENV)
    if lo and hi and lo.isdigit() and hi.isdigit():
        return PortRange(int(lo), int(hi))
    return MOONCAKE_DEFAULT_PORTS


def mooncake_port_env(cfg: ServerConfig) -> dict[str, str]:
    """The environment that pins Mooncake to --disaggregation-mooncake-ports ({} without it)."""
    r = cfg.disaggregation.mooncake_ports
    return {} if r is None else {MC_MIN_PORT_ENV: str(r.first), MC_MAX_PORT_ENV: str(r.last)}


def control_endpoints(cfg: ServerConfig) -> int:
    """ZeroMQ control endpoints a PD server opens: a prefill one per TP rank (its sender); a decode
    its receiver, plus a staging ring's per TP rank when it may stage."""
    d = cfg.disaggregation
    if not d.enabled:
        return 0
    if d.mode == "prefill":
        return cfg.tp_size
    return 1 + (cfg.tp_size if d.staging != "off" else 0)


def mooncake_engines(cfg: ServerConfig) -> int:
    """Transfer engines a server runs at once: one per TP rank for PD, one per TP rank for the KV tier."""
    d = cfg.disaggregation
    pd = cfg.tp_size if d.enabled and d.transfer_backend == "mooncake" else 0
    return pd + (cfg.tp_size if cfg.hicache.enabled else 0)


def _one(name: str, port: int, peers: tuple[Peer, ...]) -> Listener:
    """A listener on one port (0: a free one, picked at start)."""
    return Listener(name, PortRange(port, port), peers) if port else Listener(name, ANY_PORT, peers, False)


def server_listeners(cfg: ServerConfig, env: Mapping[str, str]) -> tuple[Listener, ...]:
    """Every listener of the server `cfg` configures (`env`: the environment it runs in, for
    Mooncake's range when no flag pins it)."""
    d = cfg.disaggregation
    out = [_one("http", cfg.port, (Peer.ROUTER, Peer.PROMETHEUS))]
    if d.mode == "prefill":
        out.append(_one("bootstrap", d.bootstrap_port, (Peer.PD,)))
    if control_endpoints(cfg):
        pinned = d.control_ports is not None
        out.append(Listener("control", d.control_ports or ANY_PORT, (Peer.PD,), pinned))
    if uses_mooncake(cfg):
        pinned = d.mooncake_ports is not None or MC_MIN_PORT_ENV in env
        out.append(Listener("mooncake", mooncake_ports(cfg, env), (Peer.PD,), pinned))
    return tuple(out)


def check_port_ranges(cfg: ServerConfig) -> None:
    """Refuse a pinned range too small for what the server opens in it (ConfigError naming the flag)."""
    d = cfg.disaggregation
    need = control_endpoints(cfg)
    if d.control_ports is not None and need and d.control_ports.size < need:
        raise ConfigError(
            f"--disaggregation-control-ports {d.control_ports} has {d.control_ports.size} ports; "
            f"this server opens {need} control endpoints"
        )
    need = MOONCAKE_PORTS_PER_ENGINE * mooncake_engines(cfg)
    if d.mooncake_ports is not None and need and d.mooncake_ports.size < need:
        raise ConfigError(
            f"--disaggregation-mooncake-ports {d.mooncake_ports} has {d.mooncake_ports.size} ports; this "
            f"server runs {mooncake_engines(cfg)} Mooncake engines of {MOONCAKE_PORTS_PER_ENGINE} ports each"
        )
    for lst in server_listeners(cfg, {}):
        if lst.name in ("http", "bootstrap") and lst.pinned:
            for r in (d.control_ports, d.mooncake_ports):
                if r is not None and r.first <= lst.ports.first <= r.last:
                    raise ConfigError(f"the {lst.name} port {lst.ports.first} lies inside the port range {r}")


def router_listeners(argv: Sequence[str]) -> tuple[Listener, ...]:
    """sglang-router's listeners from its flags: its API (--port) and its Prometheus exporter
    (--prometheus-port), with sglang-router 0.3.2's defaults."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--prometheus-port", type=int, default=29000)
    args, _ = p.parse_known_args(list(argv))
    return (_one("http", args.port, (Peer.CLIENTS,)), _one("metrics", args.prometheus_port, (Peer.PROMETHEUS,)))
