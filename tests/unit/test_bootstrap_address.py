"""A client's bootstrap_host / bootstrap_port parsed strictly (transfer/control/bootstrap_address.py):
an IP literal or an RFC 1123 name and a port 1..65535, nothing else; the URL a client builds from
them names that host and port only. Issue 45, finding 1."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpipe.transfer.control.bootstrap_address import parse_bootstrap_address, parse_host, parse_port
from kvpipe.transfer.control.bootstrap_info import BootstrapRefused

GOOD = {
    "127.0.0.1": "127.0.0.1",
    "10.0.0.255": "10.0.0.255",
    "::1": "::1",
    "[::1]": "::1",
    "[2001:DB8::0:1]": "2001:db8::1",
    "::ffff:127.0.0.1": "127.0.0.1",  # what an IPv4-mapped address reaches
    "[::ffff:10.1.2.3]": "10.1.2.3",
    "localhost": "localhost",
    "Prefill-0.Internal.": "prefill-0.internal",
    "a" * 63 + ".example": "a" * 63 + ".example",
    "xn--bcher-kva.example": "xn--bcher-kva.example",
}
BAD = (
    "::ffff:127.0.0.1]:9390/internal/admin?delete=1#",  # the injection
    "127.0.0.1:9390",
    "0\n",  # a trailing newline ("$" matches before it: hypothesis found it)
    "prefill-0\n",
    "10.0.0.1\n",
    "127.0.0.1/admin",
    "127.0.0.1#",
    "127.0.0.1?x=1",
    "user@127.0.0.1",
    " 127.0.0.1",
    "127.0.0.1\r\nHost: evil",
    "[127.0.0.1]",  # brackets are for IPv6
    "[localhost]",
    "[::1",
    "::1]",
    "fe80::1%eth0",  # a zone is no part of a bootstrap address
    "127.1",  # resolvers read these as 127.0.0.1: not a dotted quad, not a name
    "0x7f.0.0.1",
    "2130706433",
    "010.0.0.1",
    "1.2.3.256",
    "0.0.0.0",  # the unspecified address reaches this machine
    "::",
    "224.0.0.1",
    "",
    "-leading.example",
    "trailing-.example",
    "under_score.example",
    "a..b",
    "a" * 64 + ".example",
    "é.example",
    "x" * 300,
)


def test_ip_literals_and_names_parse_to_their_canonical_form() -> None:
    for host, canonical in GOOD.items():
        assert parse_host(host) == canonical, host


@pytest.mark.parametrize("host", BAD)
def test_anything_else_is_refused_as_a_client_error(host: str) -> None:
    with pytest.raises(BootstrapRefused, match="bootstrap_host") as e:
        parse_host(host)
    assert isinstance(e.value, ValueError)  # the engine answers it with a 400
    assert len(str(e.value)) < 200  # a 20 MB host is not echoed back


def test_a_port_is_an_integer_in_range() -> None:
    assert parse_port(None) == 8998 and parse_port(1) == 1 and parse_port(65535) == 65535 and parse_port("9000") == 9000
    for bad in (0, 65536, -1, True, False, 8998.0, "8998 ", "8998\n", "+8998", "0x20", "", "123456", [8998], b"8998"):
        with pytest.raises(BootstrapRefused, match="bootstrap_port"):
            parse_port(bad)


@given(st.text(max_size=60), st.one_of(st.none(), st.integers(-5, 70000), st.text(max_size=8)))
def test_whatever_parses_names_exactly_one_host_and_port_in_a_url(host: str, port: object) -> None:
    try:
        addr = parse_bootstrap_address(host, port)
    except BootstrapRefused:
        return
    url = httpx.URL(scheme="http", host=addr.host, port=addr.port, path="/v1/prefill/ranks")
    assert (url.host, url.port or 80, url.path, url.query, url.fragment) == (
        addr.host,
        addr.port,
        "/v1/prefill/ranks",
        b"",
        "",
    )
    assert str(addr) in {f"{addr.host}:{addr.port}", f"[{addr.host}]:{addr.port}"}
