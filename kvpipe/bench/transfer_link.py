"""Emulated link: two network namespaces joined by a rate-limited veth pair (DESIGN.md §6).

Needs root. Names carry the creating pid so concurrent runs never collide; addresses are
10.99.0.1 / 10.99.0.2, which exist only inside the namespaces created here. Cleanup runs on
close, on exit (atexit) and on SIGTERM while the link is open; `ip netns del` removes the veth
pair with its namespace.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
from types import FrameType

_RATE = re.compile(r"^\d+(\.\d+)?[kmg]?bit$")
CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class EmulatedLink:
    """`with EmulatedLink("2gbit") as link:` run one end in link.ns_a, the other in link.ns_b."""

    addr_a = "10.99.0.1"
    addr_b = "10.99.0.2"

    def __init__(self, rate: str, burst: str = "2mbit", latency: str = "50ms") -> None:
        if not _RATE.match(rate):
            raise ValueError(f"link rate {rate!r}: expected a tc rate such as 500mbit or 2gbit")
        self.rate, self.burst, self.latency = rate, burst, latency
        tag = f"kvp{os.getpid()}"
        self.ns_a, self.ns_b = f"{tag}a", f"{tag}b"
        self._veth_a, self._veth_b = f"{tag}va"[:15], f"{tag}vb"[:15]
        self._open = False
        self._old_sigterm = None

    def __enter__(self) -> "EmulatedLink":
        atexit.register(self.close)
        try:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: atexit and close() still clean up
            self._old_sigterm = None
        self._open = True
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip("link", "add", self._veth_a, "type", "veth", "peer", "name", self._veth_b)
            for ns, dev, addr in ((self.ns_a, self._veth_a, self.addr_a), (self.ns_b, self._veth_b, self.addr_b)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", self.rate, "burst", self.burst, "latency", self.latency],
                               check=True, capture_output=True, text=True, timeout=30)
        except subprocess.CalledProcessError as e:
            self.close()
            raise RuntimeError(f"setting up the emulated link failed (root needed): {e.cmd}: {e.stderr}") from e
        except BaseException:
            self.close()
            raise
        return self

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for ns in (self.ns_a, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self._veth_a], capture_output=True, timeout=30)  # if never moved
        atexit.unregister(self.close)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def __exit__(self, *exc: object) -> None:
        self.close()


def enter_netns(name: str) -> None:
    """Move the calling (single-threaded, freshly spawned) process into network namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)
