"""Which TCP ports a server listens on, from /proc: its own process and its TP workers (children).

A PD server opens more listeners than its flags say: the HTTP port, the prefill's bootstrap port,
each rank's ZeroMQ control endpoint (a random port), and each rank's Mooncake Transfer Engine, whose
P2P handshake port (the port of the rank's `data_address`) binds 0.0.0.0 and whose TCP data port
binds [::] whatever `--host` says (docs/security.md). A firewall or a Kubernetes
NetworkPolicy needs all of them, so `/server_info` gives admins this table (`listeners`) and
`kvpipe launch --firewall` closes them to everyone but the stack (launch/firewall.py).

Read without psutil: /proc/PID/fd names each socket's inode, /proc/PID/net/tcp{,6} (the network
namespace's sockets) maps inodes to local addresses and states (0A: LISTEN).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LISTEN = "0A"
MAX_PROCESSES = 256  # a server's process tree, at most (rank 0, its TP workers and their helpers)


@dataclass(frozen=True)
class Listener:
    pid: int
    host: str  # the bound address: "0.0.0.0" and "::" are every interface
    port: int

    @property
    def every_interface(self) -> bool:
        return self.host in ("0.0.0.0", "::")


def _hex_address(text: str) -> str:
    """/proc/net/tcp's address: 8 hex digits (IPv4) or 32 (IPv6), each 32-bit word in host order."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian hosts
    return str(ipaddress.ip_address(words))


def listening_inodes(proc_net_tcp: str) -> dict[int, tuple[str, int]]:
    """inode -> (host, port) of the LISTEN sockets in a /proc/net/tcp or tcp6 text."""
    out: dict[int, tuple[str, int]] = {}
    for line in proc_net_tcp.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != LISTEN:
            continue
        host, _, port = f[1].partition(":")
        out[int(f[9])] = (_hex_address(host), int(port, 16))
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (breadth first, at most MAX_PROCESSES)."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < MAX_PROCESSES:
        p = todo.pop(0)
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listeners(pids: Iterable[int]) -> list[Listener]:
    """The TCP listeners of `pids` (sorted by port)."""
    out: list[Listener] = []
    for pid in pids:
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        table: dict[int, tuple[str, int]] = {}
        for name in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{name}") as f:
                    table |= listening_inodes(f.read())
            except OSError:
                continue
        out += [Listener(pid, *table[i]) for i in inodes if i in table]
    return sorted(set(out), key=lambda listener: (listener.port, listener.host, listener.pid))


def _port(address: str | None) -> int | None:
    """The port of "tcp://host:port", "host:port" or "[v6]:port"."""
    if not address:
        return None
    tail = address.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def port_names(http_port: int, disagg: Mapping[str, Any]) -> dict[int, tuple[str, int | None]]:
    """port -> (what listens there, its TP rank) from the config and the PD connector's stats."""
    names: dict[int, tuple[str, int | None]] = {http_port: ("http", None)}
    if isinstance(disagg.get("bootstrap_port"), int):
        names[disagg["bootstrap_port"]] = ("bootstrap", None)
    for r in disagg.get("rank_addresses") or ():
        for key, what in (("data", "mooncake_handshake"), ("control", "control"), ("staging", "staging")):
            port = _port(r.get(key))
            if port is not None:
                names[port] = (what, r.get("rank"))
    return names


def port_table(found: Sequence[Listener], names: Mapping[int, tuple[str, int | None]]) -> list[dict[str, Any]]:
    """The rows of /server_info's `listeners`: every listener with what it is. A listener nothing
    names that binds every interface is Mooncake's TCP data port (each engine opens one beside its
    handshake port: a TP rank's, or the KV tier's store client's)."""
    rows = []
    for lst in found:
        what, rank = names.get(lst.port, ("mooncake_data" if lst.every_interface else "other", None))
        rows.append({"name": what, "rank": rank, "host": lst.host, "port": lst.port, "pid": lst.pid})
    return rows
