"""Where a decode may fetch bootstrap info (transfer/control/fetch_guard.py): the allow list
(which covers loopback too), loopback only without a token, the address a name is pinned to, and
the negative cache that keeps a failed bogus address from being tried again (a proven prefill is
never put there). No sockets: a fake clock and resolver."""

from __future__ import annotations

import ipaddress

import pytest

from kvpipe.config import ConfigError, DisaggregationConfig
from kvpipe.transfer.control.bootstrap import BootstrapRefused
from kvpipe.transfer.control.bootstrap_address import BootstrapAddress, parse_bootstrap_address
from kvpipe.transfer.control.fetch_guard import FetchGuard


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


NAMES = {
    "prefill.internal": ["10.1.0.5"],
    "mixed.example": ["10.1.0.6", "203.0.113.9"],  # one address outside the list
    "local.example": ["127.0.0.1", "::1"],
}


def resolve(host: str) -> list[str]:
    if host not in NAMES:
        raise OSError("Name or service not known")
    return NAMES[host]


def A(host: str, port: int = 8998) -> BootstrapAddress:  # noqa: N802 - reads like the type
    return parse_bootstrap_address(host, port)


def test_without_a_list_everything_is_allowed_and_names_are_pinned_to_their_first_address() -> None:
    g = FetchGuard((), resolve=resolve)
    for host, ip in (("10.9.9.9", "10.9.9.9"), ("prefill.internal", "10.1.0.5"), ("::1", "::1")):
        assert g.refusal(A(host)) is None
        assert g.connect_to(A(host).host) == ip
    with pytest.raises(BootstrapRefused, match="does not resolve"):
        g.connect_to("nowhere.example")


def test_the_allow_list_is_all_that_is_allowed_loopback_included() -> None:
    g = FetchGuard(("10.1.0.0/16", "Listed.Example", "2001:db8::/32"), resolve=lambda h: ["192.0.2.1"])
    for host in ("10.1.2.3", "2001:db8::7", "::ffff:10.1.0.1"):
        assert g.refusal(A(host)) is None, host
        assert g.connect_to(A(host).host) == str(ipaddress.ip_address(A(host).host)), host
    # issue 45: loopback was always allowed, so a client could make the decode fetch from any
    # local service; now it is allowed when listed, like any other network
    for host in ("10.2.0.1", "192.168.0.1", "2001:db9::1", "::ffff:10.2.0.1", "127.0.0.1", "127.5.5.5", "::1"):
        assert "not in --disaggregation-bootstrap-allow" in (g.refusal(A(host)) or ""), host
        with pytest.raises(BootstrapRefused, match="not in"):
            g.connect_to(A(host).host)
    assert g.connect_to(A("listed.example.").host) == "192.0.2.1"  # a listed name: trusted as listed
    local = FetchGuard(("127.0.0.0/8", "::1"))
    assert local.refusal(A("127.0.0.1")) is None and local.refusal(A("::1")) is None


def test_an_unlisted_name_is_checked_on_every_address_it_resolves_to() -> None:
    g = FetchGuard(("10.1.0.0/16", "127.0.0.0/8", "::1"), resolve=resolve)
    # no DNS on the engine thread: an unlisted name is checked where the fetch runs ...
    assert g.refusal(A("prefill.internal")) is None
    # ... on every address it resolves to, and the fetch connects to the address checked
    assert g.connect_to("prefill.internal") == "10.1.0.5"
    assert g.connect_to("local.example") == "127.0.0.1"
    with pytest.raises(BootstrapRefused, match="203.0.113.9"):
        g.connect_to("mixed.example")
    with pytest.raises(BootstrapRefused, match="does not resolve"):
        g.connect_to("nowhere.example")
    names_only = FetchGuard(("listed.example",), resolve=resolve)
    assert "not in" in (names_only.refusal(A("prefill.internal")) or "")  # nothing it could resolve to is allowed


def test_without_a_token_only_loopback_is_fetched_from() -> None:
    for allow in ((), ("10.0.0.0/8", "127.0.0.0/8", "::1", "local.example")):
        g = FetchGuard(allow, resolve=resolve, loopback_only=True)
        for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            assert g.refusal(A(host)) is None, (allow, host)
            assert g.connect_to(A(host).host) == A(host).host
        assert g.connect_to("local.example") == "127.0.0.1"  # listed or not: its addresses are loopback
        for host in ("10.1.2.3", "::ffff:10.1.2.3", "2001:db8::1"):
            assert "loopback" in (g.refusal(A(host)) or ""), (allow, host)
            with pytest.raises(BootstrapRefused, match="auth token"):
                g.connect_to(A(host).host)
        with pytest.raises(BootstrapRefused, match="loopback"):
            g.connect_to("prefill.internal")


def test_a_failed_unproven_address_is_refused_until_the_ttl_passes() -> None:
    clock = Clock()
    g = FetchGuard((), negative_ttl_s=10.0, clock=clock)
    bogus, other_port = A("10.0.0.66"), A("10.0.0.66", 8999)
    g.failed(bogus, "connection refused")
    assert "connection refused" in (g.refusal(bogus) or "")
    assert g.refusal(other_port) is None  # per address: a real prefill on the host is unaffected
    clock.t += 9.9
    assert g.refusal(bogus) is not None
    clock.t += 0.2
    assert g.refusal(bogus) is None  # tried again once the TTL passed


def test_a_proven_address_is_never_cached_negatively() -> None:
    clock = Clock()
    g = FetchGuard((), negative_ttl_s=10.0, clock=clock)
    real = A("10.0.0.1")
    g.failed(real, "timed out")  # before it ever answered: cached
    assert g.refusal(real) is not None and not g.proven(real)
    g.succeeded(real)  # e.g. after the TTL: proven, and the failure forgotten
    assert g.proven(real) and g.refusal(real) is None
    g.failed(real, "connection refused")  # a restart: its fetch keeps retrying instead
    assert g.refusal(real) is None


def test_bad_allow_entries_are_config_errors() -> None:
    for bad in ("10.0.0.0/33", "not a host", "-leading.dash", "1.2.3.999"):
        with pytest.raises(ConfigError, match="bootstrap-allow"):
            DisaggregationConfig(mode="decode", bootstrap_allow=(bad,))
    with pytest.raises(ConfigError, match="not one string"):
        DisaggregationConfig(mode="decode", bootstrap_allow="10.0.0.0/8")  # type: ignore[arg-type]
