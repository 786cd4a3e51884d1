"""Where a decode may fetch bootstrap info (transfer/control/fetch_guard.py): the allow list, the
address a name is pinned to, and the negative cache that keeps a failed bogus address from being
tried again (a proven prefill is never put there). No sockets: a fake clock and resolver."""

from __future__ import annotations

import pytest

from kvpipe.config import ConfigError, DisaggregationConfig
from kvpipe.transfer.control.bootstrap import BootstrapRefused
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


def test_without_a_list_everything_is_allowed_and_nothing_is_pinned() -> None:
    g = FetchGuard((), resolve=resolve)
    for host in ("10.9.9.9", "prefill.internal", "nowhere.example", "::1"):
        assert g.refusal((host, 8998)) is None
        assert g.connect_to(host) is None


def test_the_allow_list_takes_networks_names_and_always_loopback() -> None:
    g = FetchGuard(("10.1.0.0/16", "Listed.Example", "2001:db8::/32"), resolve=resolve)
    for host in ("10.1.2.3", "127.0.0.1", "127.5.5.5", "::1", "2001:db8::7", "::ffff:10.1.0.1"):
        assert g.refusal((host, 8998)) is None, host
        assert g.connect_to(host) is None, host
    for host in ("10.2.0.1", "192.168.0.1", "2001:db9::1", "::ffff:10.2.0.1"):
        assert "not in --disaggregation-bootstrap-allow" in (g.refusal((host, 8998)) or ""), host
        with pytest.raises(BootstrapRefused, match="not in"):
            g.connect_to(host)
    assert g.connect_to("listed.example.") is None  # a listed name: by name, as listed
    # an unlisted name is checked where the fetch runs (no DNS on the engine thread) ...
    assert g.refusal(("prefill.internal", 8998)) is None
    # ... on every address it resolves to, and the fetch connects to the address checked
    assert g.connect_to("prefill.internal") == "10.1.0.5"
    assert g.connect_to("local.example") == "127.0.0.1"
    with pytest.raises(BootstrapRefused, match="203.0.113.9"):
        g.connect_to("mixed.example")
    with pytest.raises(BootstrapRefused, match="does not resolve"):
        g.connect_to("nowhere.example")


def test_a_failed_unproven_address_is_refused_until_the_ttl_passes() -> None:
    clock = Clock()
    g = FetchGuard((), negative_ttl_s=10.0, clock=clock)
    bogus, other_port = ("10.0.0.66", 8998), ("10.0.0.66", 8999)
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
    real = ("10.0.0.1", 8998)
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
