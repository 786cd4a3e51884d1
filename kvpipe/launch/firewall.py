"""`kvpipe launch --firewall`: the stack's peer ports accept connections only from the stack.

Mooncake 0.3.13 binds its handshake port to 0.0.0.0 and its TCP data port to [::] whatever the
servers' `--host`, with no credential (docs/security.md): whoever reaches a
server's Mooncake ports reads and writes its KV buffers. So the launcher (root) puts a table in
the host's firewall, nftables or else iptables, that rejects (TCP reset) a new connection to a
protected port unless it comes from this host (`fib saddr type local` / `addrtype LOCAL`: every
part of a local stack) or from a network of `--firewall-allow`. Protected ports:
- the Mooncake range of the stack: its servers get `MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT` (a free
  range of MC_RANGE_SIZE ports below the kernel's ephemeral ports), and every engine of theirs
  (each TP rank's, the KV tier's) binds both its ports there, also after a restart, so they are
  covered before they are bound;
- every other port the servers listen on but HTTP (their bootstrap and ZeroMQ control ports,
  read from /proc: server/listeners.py), refreshed after each start, and the KV tier's master.
The router's and the servers' HTTP ports stay open: clients use them (with the stack's keys).

One table per stack, named after the launcher's pid and the router's port (`kvpipe_<pid>_<port>`;
iptables: chains `KVPIPE_<pid>_<port>`), created before the parts start, removed at stop; a table
whose launcher is gone (killed) is removed by the next `--firewall` start.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvpipe.config import ConfigError
from kvpipe.launch.ports import ports_taken

MC_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
MC_RANGE_SIZE = 128
MC_RANGE_FLOOR, MC_RANGE_CEIL = 20000, 32768  # Linux's ephemeral ports start at 32768
NAME = re.compile(r"^kvpipe_(\d+)_(\d+)$", re.IGNORECASE)
SBIN = ("/usr/sbin", "/sbin")

Runner = Callable[[Sequence[str], str | None], str]  # argv, stdin -> stdout (raises FirewallError)


class FirewallError(RuntimeError):
    pass


def run_command(argv: Sequence[str], stdin: str | None = None) -> str:
    try:
        r = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FirewallError(f"{argv[0]}: {e}") from None
    if r.returncode != 0:
        raise FirewallError(f"{' '.join(argv[:3])}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def find_tool(name: str, path: str | None = None) -> str | None:
    return shutil.which(name, path=os.pathsep.join([*(path or os.environ.get("PATH", "")).split(os.pathsep), *SBIN]))


def backend() -> str | None:
    """ "nft" when the host has nftables, else "iptables" when it has iptables, else None."""
    if find_tool("nft"):
        return "nft"
    if find_tool("iptables-restore") and find_tool("ip6tables-restore"):
        return "iptables"
    return None


def port_ranges(ports: Iterable[int | tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Ports and closed ranges, merged into sorted disjoint closed ranges."""
    spans = sorted((p, p) if isinstance(p, int) else p for p in ports)
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def mooncake_range(environ: Mapping[str, str] = os.environ, host: str = "127.0.0.1") -> tuple[int, int]:
    """The Mooncake port range of the stack: the environment's, else a free one of our own."""
    if all(environ.get(k, "").isdigit() for k in MC_RANGE_ENV):
        return int(environ[MC_RANGE_ENV[0]]), int(environ[MC_RANGE_ENV[1]])
    rng = random.Random()
    for _ in range(32):
        lo = rng.randrange(MC_RANGE_FLOOR, MC_RANGE_CEIL - MC_RANGE_SIZE, MC_RANGE_SIZE)
        if not ports_taken(host, range(lo, lo + MC_RANGE_SIZE)):
            return lo, lo + MC_RANGE_SIZE - 1
    raise ConfigError(f"no free range of {MC_RANGE_SIZE} ports for Mooncake in {MC_RANGE_FLOOR}..{MC_RANGE_CEIL}")


@dataclass(frozen=True)
class Rules:
    """What a stack's table holds: its protected TCP port ranges and the networks allowed beyond
    this host's own addresses."""

    name: str
    ports: tuple[tuple[int, int], ...]
    allow: tuple[str, ...] = ()

    def _nets(self, version: int) -> list[str]:
        return [n for n in self.allow if ipaddress.ip_network(n, strict=False).version == version]

    def nft_script(self) -> str:
        """One nft transaction: the table replaced whole (atomic), or made."""
        spans = ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in self.ports) or "0"
        lines = [
            f"table inet {self.name} {{}}",
            f"delete table inet {self.name}",
            f"table inet {self.name} {{",
            f"  set ports {{ type inet_service; flags interval; elements = {{ {spans} }} }}",
            "  chain input {",
            "    type filter hook input priority filter - 1; policy accept;",
            "    tcp dport != @ports accept",
            "    ct state established,related accept",
            "    fib saddr type local accept",
        ]
        for family, version in (("ip", 4), ("ip6", 6)):
            lines += [f"    {family} saddr {n} accept" for n in self._nets(version)]
        return "\n".join([*lines, "    reject with tcp reset", "  }", "}", ""])

    def iptables_restore(self, version: int) -> str:
        """iptables-restore --noflush input: the stack's chain flushed and refilled (atomic)."""
        chain = self.name.upper()
        lines = [
            "*filter",
            f":{chain} - [0:0]",
            f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
            f"-A {chain} -m addrtype --src-type LOCAL -j RETURN",
            *(f"-A {chain} -s {n} -j RETURN" for n in self._nets(version)),
        ]
        spans = [f"{lo}:{hi}" if lo != hi else str(lo) for lo, hi in self.ports]
        for i in range(0, len(spans), 7):  # multiport: 15 ports at most, a range counts 2
            ports = ",".join(spans[i : i + 7])
            lines.append(f"-A {chain} -p tcp -m multiport --dports {ports} -j REJECT --reject-with tcp-reset")
        return "\n".join([*lines, "COMMIT", ""])


class Firewall:
    """The stack's table in the host's firewall (`kind`: "nft" or "iptables")."""

    def __init__(self, name: str, allow: Sequence[str], kind: str, run: Runner = run_command) -> None:
        self.name, self.allow, self.kind, self._run = name, tuple(allow), kind, run
        self.applied: Rules | None = None

    def apply(self, ports: Iterable[int | tuple[int, int]]) -> Rules:
        rules = Rules(self.name, port_ranges(ports), self.allow)
        if self.kind == "nft":
            self._run(["nft", "-f", "-"], rules.nft_script())
        else:
            for tool, version in (("iptables", 4), ("ip6tables", 6)):
                self._run([f"{tool}-restore", "--noflush"], rules.iptables_restore(version))
                jump = ["INPUT", "-p", "tcp", "-j", self.name.upper()]
                try:
                    self._run([tool, "-C", *jump], None)
                except FirewallError:
                    self._run([tool, "-I", *jump], None)
        self.applied = rules
        return rules

    def close(self) -> None:
        """Remove the table (nothing when none was made)."""
        if self.applied is not None:
            remove_table(self.kind, self.name, self._run)
            self.applied = None


def remove_table(kind: str, name: str, run: Runner = run_command) -> None:
    if kind == "nft":
        run(["nft", "delete", "table", "inet", name], None)
        return
    for tool in ("iptables", "ip6tables"):
        chain = name.upper()
        for argv in (["-D", "INPUT", "-p", "tcp", "-j", chain], ["-F", chain], ["-X", chain]):
            try:
                run([tool, *argv], None)
            except FirewallError:
                continue  # half made: remove the rest


def stack_tables(kind: str, run: Runner = run_command) -> list[str]:
    """The names of every kvpipe stack's table in the firewall."""
    if kind == "nft":
        found = re.findall(r"table inet (\S+)", run(["nft", "list", "tables", "inet"], None))
    else:
        found = re.findall(r"^-N (\S+)$", run(["iptables", "-S"], None), re.MULTILINE)
    return [n.lower() for n in found if NAME.match(n)]


def remove_stale(kind: str, alive: Callable[[int], bool], run: Runner = run_command) -> list[str]:
    """Remove the tables of stacks whose launcher is gone; their names."""
    gone = []
    for name in stack_tables(kind, run):
        m = NAME.match(name)
        if m and not alive(int(m.group(1))):
            remove_table(kind, name, run)
            gone.append(name)
    return gone


@dataclass(frozen=True)
class FirewallSpec:
    """`--firewall`: this host's addresses and `allow` (networks) may reach the stack's peer ports."""

    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for n in self.allow:
            try:
                ipaddress.ip_network(n, strict=False)
            except ValueError:
                raise ConfigError(
                    f"--firewall-allow takes networks (10.0.0.0/8, 2001:db8::/32, 10.1.2.3): {n!r}"
                ) from None

    def open(self, router_port: int, alive: Callable[[int], bool]) -> Firewall:
        """The stack's (empty) firewall, after the tables of dead stacks are gone; ConfigError
        when this host or user cannot have one."""
        if os.geteuid() != 0:
            raise ConfigError("--firewall changes the host's firewall: run kvpipe launch as root")
        kind = backend()
        if kind is None:
            raise ConfigError("--firewall needs nftables (`nft`) or iptables: apt-get install nftables")
        remove_stale(kind, alive)
        return Firewall(f"kvpipe_{os.getpid()}_{router_port}", self.allow, kind)
