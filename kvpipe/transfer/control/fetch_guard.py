"""Where a decode may fetch a prefill's bootstrap info from, and what it will not try again soon.

The bootstrap host and port come from the client's request body (the router fills them in), so a
decode must not fetch wherever a client says:
- an allow list (`--disaggregation-bootstrap-allow`: networks in CIDR notation or host names;
  empty: anywhere; loopback is always allowed): a literal address must lie in a network, a name
  must be listed or resolve to allowed addresses only, and the fetch then connects to the address
  that was checked (`connect_to`), so the name cannot point elsewhere between check and connect;
- an address this decode fetched from successfully is *proven* (a real prefill): its fetches run
  apart from the others (KVReceiver) and keep retrying while a restarted prefill comes back;
- an unproven address whose fetch failed is refused for `negative_ttl_s` without a new try: a
  bogus host costs one attempt (at most the HTTP timeout) per TTL, not a fetch worker for the
  whole bootstrap timeout of every request that names it.

    guard = FetchGuard(("10.0.0.0/8", "prefill-0.internal"), negative_ttl_s=10.0)
    why = guard.refusal(("10.1.2.3", 8998))   # None, or why not (cheap: no DNS; the engine asks)
    ip = guard.connect_to("prefill-0.internal")  # fetch worker: None (connect by name) or the checked
                                                 # address; BootstrapRefused when not allowed
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
from kvpipe.transfer.control.bootstrap import BootstrapRefused

Address = tuple[str, int]  # a bootstrap server: host, port
MAX_REMEMBERED = 4096  # proven and failed addresses each (oldest forgotten first)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
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
    ) -> None:
        self._networks, self._names = parse_bootstrap_allow(allow)
        self.restricted = bool(allow)
        self._ttl = negative_ttl_s
        self._clock = clock
        self._resolve = resolve or _resolve
        self._lock = threading.Lock()
        self._proven: OrderedDict[Address, None] = OrderedDict()
        self._failed: OrderedDict[Address, tuple[float, str]] = OrderedDict()  # addr -> (until, why)

    def _allowed_ip(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:a.b.c.d reaches a.b.c.d
        return ip.is_loopback or any(ip.version == net.version and ip in net for net in self._networks)

    def refusal(self, addr: Address) -> str | None:
        """Why a fetch from `addr` is refused now, as far as this can tell without DNS (a name
        that is not listed is resolved and checked by the fetch: connect_to); None: go ahead."""
        host = addr[0]
        with self._lock:
            bad = self._failed.get(addr)
            if bad is not None:
                if bad[0] > self._clock():
                    return (
                        f"bootstrap server {host}:{addr[1]} failed {self._ttl:g}s ago or less ({bad[1]}); "
                        "not tried again before then"
                    )
                del self._failed[addr]
        if not self.restricted:
            return None
        ip = _ip(host)
        if ip is not None and not self._allowed_ip(ip):
            return f"bootstrap host {host} is not in --disaggregation-bootstrap-allow"
        return None

    def connect_to(self, host: str) -> str | None:
        """Where a fetch from `host` connects: None (by name: no allow list, or a listed name, or
        a literal address) or the allowed address `host` resolved to. BootstrapRefused if `host`
        is not allowed (a name: when any of its addresses is not)."""
        if not self.restricted or host.lower().rstrip(".") in self._names:
            return None
        ip = _ip(host)
        if ip is not None:
            if not self._allowed_ip(ip):
                raise BootstrapRefused(f"bootstrap host {host} is not in --disaggregation-bootstrap-allow")
            return None
        try:
            found = self._resolve(host)
        except OSError as e:
            raise BootstrapRefused(f"bootstrap host {host} does not resolve: {e}") from None
        ips = [i for i in (_ip(a) for a in found) if i is not None]
        if not ips or not all(self._allowed_ip(i) for i in ips):
            raise BootstrapRefused(
                f"bootstrap host {host} resolves to {sorted(set(found))}, not all inside "
                "--disaggregation-bootstrap-allow"
            )
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
