"""Where a decode may fetch a prefill's bootstrap info from, and what it will not try again soon.

The bootstrap host and port come from the client's request body (the router fills them in), so a
decode must not fetch wherever a client says. The address is parsed strictly first
(bootstrap_address.py: an IP literal or a DNS name, a port 1..65535), then:
- an allow list (`--disaggregation-bootstrap-allow`: networks in CIDR notation or host names)
  is all that is allowed, loopback included (list 127.0.0.0/8 or ::1 to allow it); an empty list
  allows any address;
- without a PD auth token (and without --disaggregation-insecure) only loopback addresses are
  allowed, whatever the list says (an unauthenticated decode would otherwise fetch from, and
  register with, whatever a client names);
- a literal address must be allowed; a name must be listed (then trusted as listed) or resolve
  to allowed addresses only; the fetch connects to the address checked (`connect_to`), so the
  name cannot point elsewhere between check and connect, and signs that address (auth.py);
- an address this decode fetched from successfully is *proven* (a real prefill): its fetches run
  apart from the others (KVReceiver) and keep retrying while a restarted prefill comes back;
- an unproven address whose fetch failed is refused for `negative_ttl_s` without a new try: a
  bogus host costs one attempt (at most the HTTP timeout) per TTL, not a fetch worker for the
  whole bootstrap timeout of every request that names it.

    guard = FetchGuard(("10.0.0.0/8", "prefill-0.internal"), negative_ttl_s=10.0)
    addr = parse_bootstrap_address(host, port)   # BootstrapRefused (a 400) for a malformed one
    why = guard.refusal(addr)                    # None, or why not (cheap: no DNS; the engine asks)
    ip = guard.connect_to(addr.host)             # fetch worker: the checked address to connect to;
                                                 # BootstrapRefused when not allowed
    guard.succeeded(addr) / guard.failed(addr, why); guard.proven(addr)
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpipe.config import parse_bootstrap_allow
from kvpipe.transfer.control.bootstrap_address import IP, BootstrapAddress, canonical_ip
from kvpipe.transfer.control.bootstrap_info import BootstrapRefused

Address = BootstrapAddress
MAX_REMEMBERED = 4096  # proven and failed addresses each (oldest forgotten first)
LOOPBACK_ONLY = (
    "without a PD auth token (--disaggregation-auth-token-file) a decode fetches bootstrap info from "
    "loopback addresses only (--disaggregation-insecure: from anywhere)"
)


def _ip(host: str) -> IP | None:
    try:
        return canonical_ip(ipaddress.ip_address(host))
    except ValueError:
        return None


class FetchGuard:
    """Thread-safe: the engine thread asks `refusal`, fetch workers the rest."""

    def __init__(
        self,
        allow: Sequence[str] = (),
        negative_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        resolve: Callable[[str], list[str]] | None = None,
        loopback_only: bool = False,
    ) -> None:
        """`loopback_only`: the decode has no PD auth token (and no --disaggregation-insecure)."""
        self._networks, self._names = parse_bootstrap_allow(allow)
        self.restricted = bool(allow)
        self.loopback_only = loopback_only
        self._ttl = negative_ttl_s
        self._clock = clock
        self._resolve = resolve or _resolve
        self._lock = threading.Lock()
        self._proven: OrderedDict[Address, None] = OrderedDict()
        self._failed: OrderedDict[Address, tuple[float, str]] = OrderedDict()  # addr -> (until, why)

    def _why_not(self, ip: IP, host: str) -> str | None:
        """Why a fetch may not connect to `ip` (`host`: what the request named), or None."""
        ip = canonical_ip(ip)  # ::ffff:a.b.c.d reaches a.b.c.d
        if self.loopback_only and not ip.is_loopback:
            return f"bootstrap host {host} is not a loopback address: {LOOPBACK_ONLY}"
        if self.restricted and not any(ip.version == net.version and ip in net for net in self._networks):
            return f"bootstrap host {host} is not in --disaggregation-bootstrap-allow"
        return None

    def refusal(self, addr: Address) -> str | None:
        """Why a fetch from `addr` is refused now, as far as this can tell without DNS (a name
        that is not listed is resolved and checked by the fetch: connect_to); None: go ahead."""
        host = addr.host
        with self._lock:
            bad = self._failed.get(addr)
            if bad is not None:
                if bad[0] > self._clock():
                    return (
                        f"bootstrap server {addr} failed {self._ttl:g}s ago or less ({bad[1]}); "
                        "not tried again before then"
                    )
                del self._failed[addr]
        ip = _ip(host)
        if ip is not None:
            return self._why_not(ip, host)
        if self.restricted and not self.loopback_only and host not in self._names and not self._networks:
            return f"bootstrap host {host} is not in --disaggregation-bootstrap-allow"
        return None

    def connect_to(self, host: str) -> str:
        """The address a fetch from `host` (canonical, bootstrap_address.py) connects to: the
        literal itself, a listed name's first address, or the first of the allowed addresses an
        unlisted name resolves to. BootstrapRefused if `host` is not allowed (a name: when any
        of its addresses is not)."""
        ip = _ip(host)
        if ip is not None:
            why = self._why_not(ip, host)
            if why is not None:
                raise BootstrapRefused(why)
            return str(ip)
        try:
            found = self._resolve(host)
        except OSError as e:
            raise BootstrapRefused(f"bootstrap host {host} does not resolve ({type(e).__name__})", str(e)) from None
        ips = [i for i in (_ip(a.split("%")[0]) for a in found) if i is not None]
        if not ips:
            raise BootstrapRefused(f"bootstrap host {host} resolves to no address")
        if self.restricted and host in self._names and not self.loopback_only:
            return str(ips[0])  # listed by name: trusted as listed
        for i in ips:
            why = self._why_not(i, host)
            if why is not None:
                raise BootstrapRefused(f"{why} (it resolves to {sorted({str(a) for a in ips})})")
        return str(ips[0])

    def proven(self, addr: Address) -> bool:
        with self._lock:
            return addr in self._proven

    def succeeded(self, addr: Address) -> None:
        with self._lock:
            self._failed.pop(addr, None)
            self._proven[addr] = None
            self._proven.move_to_end(addr)
            while len(self._proven) > MAX_REMEMBERED:
                self._proven.popitem(last=False)

    def failed(self, addr: Address, why: str) -> None:
        """An unproven address failed: refuse it for the TTL (a proven one is retried instead)."""
        with self._lock:
            if addr in self._proven:
                return
            self._failed[addr] = (self._clock() + self._ttl, why[:200])
            self._failed.move_to_end(addr)
            while len(self._failed) > MAX_REMEMBERED:
                self._failed.popitem(last=False)


def _resolve(host: str) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
