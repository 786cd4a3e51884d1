"""Emulated link: two network namespaces joined by a veth pair, tbf-shaped on both ends.

    with LinkTestbed("1gbit") as tb:
        p = tb.popen("a", [sys.executable, "-m", "kvpipe.cli", "serve", "--host", tb.addr_a, ...])
        tb.call_in("b", httpx.get, f"http://{tb.addr_a}:{port}/health")

Side "a" (10.99.0.1) and side "b" (10.99.0.2) each see only the other end and their own lo;
the 10.x addresses exist only inside these namespaces, so every run may use the same ones.
Names carry the pid and a random tag, so concurrent runs never collide. Teardown always runs:
`close()` from `__exit__`, an atexit hook, and SIGTERM turned into SystemExit (Ctrl-C already
raises KeyboardInterrupt) so `finally` blocks run; a SIGKILLed owner leaves a state file that
`kvpipe testbed down` uses to clean up.
Deleting a namespace destroys its veth end (and with it the pair). Needs root and iproute2.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvpipe.launch.process import stop_process

T = TypeVar("T")
Side = Literal["a", "b"]

NETNS_RUN_DIR = Path("/var/run/netns")
CLONE_NEWNET = 0x40000000
_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([a-z]+)$")


class LinkTestbedError(RuntimeError):
    """The testbed could not be created or used (not root, no iproute2, a command failed)."""


def default_state_dir() -> Path:
    """Where testbeds are recorded: $KVPIPE_TESTBED_DIR, else <tmp>/kvpipe-testbed."""
    return Path(os.environ.get("KVPIPE_TESTBED_DIR") or Path(tempfile.gettempdir()) / "kvpipe-testbed")


def parse_rate(rate: str) -> tuple[str, float]:
    """tc rate string ("500mbit", "2gbit", "100mbps" = bytes/s) -> (normalised string, bits/s)."""
    s = rate.strip().lower()
    m = _RATE_RE.match(s)
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"bad link rate {rate!r}: expected a positive number with a tc unit "
            f"({', '.join(_UNITS)}), e.g. 500mbit or 2gbit"
        )
    return s, float(m.group(1)) * _UNITS[m.group(2)]


DEFAULT_MTU = 1500
MIN_MTU, MAX_MTU = 1280, 65535  # IPv6's minimum; the largest a veth takes


@dataclass(frozen=True)
class LinkSpec:
    name: str
    rate: str
    rate_bps: float
    burst_bytes: int
    latency_ms: int = 50
    addr_a: str = "10.99.0.1"
    addr_b: str = "10.99.0.2"
    prefix: int = 24
    # the veth MTU: Linux's default 1500, or jumbo frames (9000, a datacenter link's usual MTU:
    # 6x fewer packets and ACKs for the kernels of both ends, which here share the servers' cores)
    mtu: int = DEFAULT_MTU
    # TCP's retransmission timeout cap in both namespaces (net.ipv4.tcp_rto_max_ms, recent kernels;
    # None: the kernel's 120 s): after a partition, connections resume within it (docs/faults.md)
    rto_max_ms: int | None = None

    @property
    def ns_a(self) -> str:
        return f"{self.name}-a"

    @property
    def ns_b(self) -> str:
        return f"{self.name}-b"

    @property
    def veth_a(self) -> str:  # interface names are limited to 15 characters
        return f"{self.name.replace('-', '')[:13]}a"

    @property
    def veth_b(self) -> str:
        return f"{self.name.replace('-', '')[:13]}b"

    def ns(self, side: Side) -> str:
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return self.ns_a if side == "a" else self.ns_b


# tbf splits a packet larger than its bucket into MTU-sized ones. A TCP sender hands the veth GSO
# packets of up to 64 KiB of payload, which tbf counts with every segment's headers (~68 KB at
# MTU 1500): with a 64 KiB bucket each was split, and both kernels then handled 45x as many packets
# as a NIC with TSO and GRO lets them (measured: 1,475 bytes per packet through tbf at MTU 1500).
# A bucket of twice that keeps them whole, as the offloads of a real link do.
MIN_BURST_BYTES = 128 * 1024


def make_spec(
    rate: str,
    burst_bytes: int | None = None,
    latency_ms: int = 50,
    mtu: int = DEFAULT_MTU,
    rto_max_ms: int | None = None,
) -> LinkSpec:
    """A spec with fresh unique names; burst defaults to 1 ms at line rate, at least
    MIN_BURST_BYTES (2 Gbit/s gives a 2 Mbit burst)."""
    norm, bps = parse_rate(rate)
    burst = burst_bytes if burst_bytes is not None else max(MIN_BURST_BYTES, int(bps / 8 / 1000))
    if burst < 2048 or latency_ms < 1:
        raise ValueError(f"burst must be >= 2048 bytes and latency >= 1 ms, got {burst}, {latency_ms}")
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise ValueError(f"mtu must be in [{MIN_MTU}, {MAX_MTU}], got {mtu}")
    if rto_max_ms is not None and rto_max_ms < 1:
        raise ValueError(f"the RTO cap must be >= 1 ms, got {rto_max_ms}")
    # "kv" + pid + 4 hex: short enough for veth names, unique across processes and within one.
    return LinkSpec(
        f"kv{os.getpid()}{secrets.token_hex(2)}", norm, bps, burst, latency_ms, mtu=mtu, rto_max_ms=rto_max_ms
    )


def setup_commands(s: LinkSpec) -> list[list[str]]:
    """Two namespaces joined by a veth pair with a tbf qdisc on both ends (docs/architecture.md,
    transfer engine facts), the veth ends created directly inside the namespaces (never in ours)."""
    cmds = [
        ["ip", "netns", "add", s.ns_a],
        ["ip", "netns", "add", s.ns_b],
        ["ip", "link", "add", s.veth_a, "netns", s.ns_a, "type", "veth", "peer", "name", s.veth_b, "netns", s.ns_b],
    ]
    for ns, dev, addr in ((s.ns_a, s.veth_a, s.addr_a), (s.ns_b, s.veth_b, s.addr_b)):
        cmds += [
            ["ip", "-n", ns, "addr", "add", f"{addr}/{s.prefix}", "dev", dev],
            ["ip", "-n", ns, "link", "set", dev, "mtu", str(s.mtu)],
            ["ip", "-n", ns, "link", "set", dev, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            *(
                [["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_rto_max_ms={s.rto_max_ms}"]]
                if s.rto_max_ms
                else []
            ),
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",  # netem faults go under its class 1:1 (link_faults.py)
                "tbf",
                "rate",
                s.rate,
                "burst",
                str(s.burst_bytes),
                "latency",
                f"{s.latency_ms}ms",
            ],
        ]
    return cmds


def teardown_commands(s: LinkSpec) -> list[list[str]]:
    return [["ip", "netns", "del", s.ns_a], ["ip", "netns", "del", s.ns_b]]


def _tools_path() -> str:
    """PATH with the sbin directories: Debian puts `tc` in /usr/sbin, which a non-login shell's
    PATH may lack (and `ip netns exec` looks `tc` up in the PATH it is given)."""
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def tool(name: str) -> str:
    """The path of an iproute2 tool (its bare name if not found: running it then says so)."""
    return shutil.which(name, path=_tools_path()) or name


def missing_tools() -> list[str]:
    return [name for name in ("ip", "tc") if tool(name) == name]


def can_run() -> bool:
    """Root with iproute2: what the testbed needs (tests skip without it)."""
    return os.geteuid() == 0 and not missing_tools()


def check_privileges() -> None:
    if os.geteuid() != 0:
        raise LinkTestbedError(
            "the link testbed needs root (network namespaces, veth, tc): run as root or with sudo -E"
        )
    for tool in missing_tools():
        raise LinkTestbedError(f"`{tool}` not found: install iproute2")


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={**os.environ, "PATH": _tools_path()})
    if check and r.returncode != 0:
        raise LinkTestbedError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def namespace_exists(ns: str) -> bool:
    return (NETNS_RUN_DIR / ns).exists()


def kill_namespace_pids(ns: str, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the processes still inside `ns` (a namespace this module created)."""

    def pids() -> list[int]:
        r = _run(["ip", "netns", "pids", ns], check=False)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []

    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 2.0)):
        left = pids()
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = pids()
        if not left:
            return


def remove_testbed(s: LinkSpec) -> None:
    """Stop what runs inside, delete both namespaces (errors ignored: best effort, idempotent)."""
    for ns in (s.ns_a, s.ns_b):
        if namespace_exists(ns):
            kill_namespace_pids(ns)
    for cmd in teardown_commands(s):
        _run(cmd, check=False)


def enter_netns(ns: str) -> None:
    """Move the calling thread into namespace `ns` (setns is per thread on Linux). Called first
    thing in a freshly spawned child, it moves the process's networking: every thread started
    later (Mooncake's) inherits the namespace; only a pool a library started at import (BLAS)
    stays behind, and it opens no sockets."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_RUN_DIR / ns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkTestbedError(f"setns into {ns} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside_netns(ns: str) -> Iterator[None]:
    """The calling thread inside namespace `ns` for the block, then back where it was. Threads and
    subprocesses started meanwhile stay in `ns` (a harness that drives a stack from one side)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter_netns(ns)
        try:
            yield
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise LinkTestbedError(f"setns back from {ns} failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(home)


def run_in_netns(ns: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call fn in a fresh thread switched into namespace `ns`, so the sockets fn opens live there;
    the calling thread and later subprocesses are unaffected."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            enter_netns(ns)
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class LinkTestbed:
    """Context manager owning one testbed; `persistent=True` (used by `kvpipe testbed up`) keeps it
    after this process exits, removed later by `kvpipe testbed down`."""

    def __init__(
        self,
        rate: str,
        *,
        burst_bytes: int | None = None,
        latency_ms: int = 50,
        mtu: int = DEFAULT_MTU,
        persistent: bool = False,
        state_dir: Path | None = None,
        rto_max_ms: int | None = None,
    ) -> None:
        self.spec = make_spec(rate, burst_bytes, latency_ms, mtu, rto_max_ms)
        self.persistent = persistent
        self.state_path = Path(state_dir or default_state_dir()) / f"{self.spec.name}.json"
        self._procs: list[subprocess.Popen] = []
        self._active = False
        self._old_sigterm: Any = None

    # ---- addresses and names ---------------------------------------------------------------------
    @property
    def ns_a(self) -> str:
        return self.spec.ns_a

    @property
    def ns_b(self) -> str:
        return self.spec.ns_b

    @property
    def addr_a(self) -> str:
        return self.spec.addr_a

    @property
    def addr_b(self) -> str:
        return self.spec.addr_b

    def exec_prefix(self, side: Side) -> list[str]:
        return ["ip", "netns", "exec", self.spec.ns(side)]

    # ---- lifecycle -------------------------------------------------------------------------------
    def up(self) -> LinkTestbed:
        check_privileges()
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "spec": asdict(self.spec),
            "owner_pid": os.getpid(),
            "persistent": self.persistent,
            "created": time.time(),
        }
        self.state_path.write_text(json.dumps(state, indent=2) + "\n")  # first: a crash stays findable
        self._active = True
        if not self.persistent:
            atexit.register(self.close)
            if threading.current_thread() is threading.main_thread():
                self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            for cmd in setup_commands(self.spec):
                _run(cmd)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop our processes and delete both namespaces; safe to call again (atexit does)."""
        if not self._active:
            return
        for p in reversed(self._procs):
            stop_process(p)
        self._procs.clear()
        remove_testbed(self.spec)
        self.state_path.unlink(missing_ok=True)
        self._active = False
        atexit.unregister(self.close)
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __enter__(self) -> LinkTestbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- running things inside -------------------------------------------------------------------
    def popen(self, side: Side, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` inside a namespace in its own session (stop_process kills its group);
        it is stopped by close() if still running."""
        if not self._active:
            raise LinkTestbedError("the testbed is not up")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen([*self.exec_prefix(side), *cmd], **kwargs)
        self._procs.append(p)
        return p

    def call_in(self, side: Side, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) with its sockets inside that side's namespace."""
        return run_in_netns(self.spec.ns(side), fn, *args, **kwargs)
