"""`bench soak --link-fault`: its options, and the time to full service after a heal from the
load's outcomes (pure)."""

from __future__ import annotations

import argparse

import pytest

from kvpipe.harness.link_faults import FaultKind
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Request
from kvpipe.harness.testbed import make_spec, setup_commands
from kvpipe.qa import soak
from kvpipe.qa.soak_link import full_service_s


def _sent(start: float, end: End, message: str = "") -> Outcome:
    return Outcome(Request(0, (1, 2), 4), end, start, start + 1.0, 2, message=message)


def test_full_service_counts_from_the_first_request_after_which_all_were_served() -> None:
    err = "KV transfer failed"
    outcomes = [
        _sent(5.0, End.HTTP_ERROR, err),  # before the heal: not counted
        _sent(10.5, End.HTTP_ERROR, err),
        _sent(11.0, End.OK),
        _sent(11.5, End.HTTP_ERROR, err),  # service not yet full
        _sent(12.5, End.OK),
        _sent(13.0, End.DISCONNECTED),  # our own disconnect: served
    ]
    assert full_service_s(outcomes, 10.0) == pytest.approx(2.5)
    assert full_service_s(outcomes[:1] + outcomes[4:], 10.0) == pytest.approx(2.5)
    assert full_service_s([_sent(10.2, End.OK)], 10.0) == pytest.approx(0.2)
    assert full_service_s(outcomes[:4], 10.0) is None  # the last one sent failed
    assert full_service_s(outcomes[:1], 10.0) is None  # nothing sent after the heal
    assert full_service_s(outcomes, None) is None  # never healed


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    soak.add_args(p)
    return p.parse_args(list(argv))


def test_link_fault_options() -> None:
    assert soak.link_from_args(_args()) is None
    link = soak.link_from_args(_args("--link-fault", "partition:6s", "--link-rate", "8mbit", "--link-fault-after", "3"))
    assert link is not None and link.fault.kind is FaultKind.PARTITION and link.fault.duration_s == 6.0
    assert (link.rate, link.after_s) == ("8mbit", 3.0)
    with pytest.raises(SystemExit, match="bad link fault 'loss:1'"):
        soak.link_from_args(_args("--link-fault", "loss:1"))


def test_the_testbed_caps_tcps_retransmission_timeout_when_asked() -> None:
    # after a 15 s partition connections waited ~12 s for their backed-off retransmission
    # (docs/faults.md); the cap is the namespaces' own sysctl, never the host's
    spec = make_spec("100mbit", rto_max_ms=1000)
    sysctls = [c for c in setup_commands(spec) if "sysctl" in c]
    assert sorted(c[3] for c in sysctls) == sorted([spec.ns_a, spec.ns_b])
    assert all(c[:3] == ["ip", "netns", "exec"] and c[-1] == "net.ipv4.tcp_rto_max_ms=1000" for c in sysctls)
    assert not [c for c in setup_commands(make_spec("100mbit")) if "sysctl" in c]
    with pytest.raises(ValueError, match="RTO cap"):
        make_spec("100mbit", rto_max_ms=0)
    link = soak.link_from_args(_args("--link-fault", "partition:6s", "--link-rto-max-ms", "1000"))
    assert link is not None and link.rto_max_ms == 1000
