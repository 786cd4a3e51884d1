"""A prefill's bootstrap address as a client's request names it, parsed strictly.

`bootstrap_host` and `bootstrap_port` come from the request body (sglang-router fills them in,
but anyone who reaches the decode's API can), and the decode connects there. Issue 45, finding
1: a host of `::ffff:127.0.0.1]:9390/internal/admin?delete=1#` pasted into a URL made the decode
send `GET /internal/admin?delete=1` to another local service. So a host is exactly one of

- an IPv4 literal (dotted quad: `127.0.0.1`; not `127.1` nor `0x7f.1`, which resolvers take too);
- an IPv6 literal, bare or in brackets (`::1`, `[::1]`), without a zone (`%eth0`); an
  IPv4-mapped one (`::ffff:127.0.0.1`) is its IPv4 address (that is what it reaches);
- a DNS name of RFC 1123 labels (letters, digits, inner hyphens, 1-63 characters each, at most
  253 in all, an optional trailing dot) whose last label is not all digits;

and a port is an integer 1..65535 (a bool, a float or a string with anything but 1-5 digits is
refused; None is the default port). Anything else raises `BootstrapRefused` (a ValueError: the
request gets a 400 and nothing connects anywhere). URLs are then built from the parts
(`httpx.URL(scheme=, host=, port=, path=)`), never pasted from strings.

    addr = parse_bootstrap_address("[::1]", 8998)   # BootstrapAddress(host="::1", port=8998)
    addr.ip                                         # IPv6Address('::1'); None for a name
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

from kvpipe.transfer.control.bootstrap_info import DEFAULT_BOOTSTRAP_PORT, BootstrapRefused

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_HOST_CHARS = 253  # a DNS name's limit (RFC 1035); longer is no host at all
# matched with fullmatch: "$" would also match before a trailing newline ("0\n" was a host name)
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_DOTTED_QUAD = re.compile(r"(0|[1-9][0-9]{0,2})(\.(0|[1-9][0-9]{0,2})){3}")
_PORT_DIGITS = re.compile(r"[0-9]{1,5}")


class BootstrapAddress(NamedTuple):
    """A checked bootstrap address: `host` an IP in its canonical form (no brackets) or a lower-case
    DNS name without its trailing dot. A tuple, so it keys dicts as (host, port) did before."""

    host: str
    port: int

    @property
    def ip(self) -> IP | None:
        return _literal(self.host)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _literal(host: str) -> IP | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def canonical_ip(ip: IP) -> IP:
    """An IPv4-mapped IPv6 address as the IPv4 address it reaches."""
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None else ip


def _show(value: object) -> str:
    return repr(value)[:80]


def parse_host(host: object) -> str:
    """The canonical form of a bootstrap host; BootstrapRefused for anything but an IP literal or
    a DNS name (module docstring)."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS + 2:
        raise BootstrapRefused(f"bootstrap_host {_show(host)} is not an IP address or a host name")
    bracketed = host.startswith("[") and host.endswith("]")
    inner = host[1:-1] if bracketed else host
    if ":" in inner:  # only an IPv6 literal has colons; brackets are for it alone
        ip = _literal(inner) if "%" not in inner else None
        if not isinstance(ip, ipaddress.IPv6Address):
            raise BootstrapRefused(f"bootstrap_host {_show(host)} is not an IPv6 address")
        return _usable(canonical_ip(ip), host)
    if bracketed or "[" in host or "]" in host:
        raise BootstrapRefused(f"bootstrap_host {_show(host)}: brackets hold an IPv6 address only")
    if _DOTTED_QUAD.fullmatch(inner):
        ip = _literal(inner)
        if ip is None:
            raise BootstrapRefused(f"bootstrap_host {_show(host)} is not an IPv4 address")
        return _usable(ip, host)
    name = inner.lower()
    name = name[:-1] if name.endswith(".") else name
    labels = name.split(".")
    if len(name) > MAX_HOST_CHARS or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise BootstrapRefused(f"bootstrap_host {_show(host)} is not an IP address or a host name (RFC 1123)")
    return name


def _usable(ip: IP, host: str) -> str:
    """An address a fetch may connect to: not the unspecified one (0.0.0.0 and :: reach this
    machine on Linux) nor a multicast group."""
    if ip.is_unspecified or ip.is_multicast:
        raise BootstrapRefused(f"bootstrap_host {_show(host)} is not a unicast address")
    return str(ip)


def parse_port(port: object) -> int:
    """A bootstrap port: None is the default, else an int (or a string of its digits) in 1..65535."""
    if port is None:
        return DEFAULT_BOOTSTRAP_PORT
    if isinstance(port, str) and _PORT_DIGITS.fullmatch(port):
        value = int(port)
    elif type(port) is int:
        value = port
    else:
        raise BootstrapRefused(f"bootstrap_port {_show(port)} is not an integer port")
    if not 1 <= value <= 65535:
        raise BootstrapRefused(f"bootstrap_port {value} is outside 1..65535")
    return value


def parse_bootstrap_address(host: object, port: object) -> BootstrapAddress:
    return BootstrapAddress(parse_host(host), parse_port(port))
