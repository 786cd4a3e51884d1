"""receiver/lost.py on explicit clock values: when a lost prefill is looked for, how many are kept, and
what the decode says about them."""

from __future__ import annotations

from kvpipe.transfer.control.bootstrap_address import BootstrapAddress
from kvpipe.transfer.receiver.lost import MAX_LOST, LostPrefills

A, B = BootstrapAddress("10.0.0.1", 8998), BootstrapAddress("10.0.0.2", 8998)


def test_looks_come_every_retry_interval_except_while_one_runs() -> None:
    lost = LostPrefills(retry_s=1.0, forget_s=10.0)
    lost.lost(A, 0.0)
    lost.lost(A, 0.5)  # dropped again (another rank): still lost since 0.0
    assert lost.since == {A: 0.0} and lost.due(1.0, busy=()) == []  # next look at 1.5
    assert lost.due(1.5, busy=()) == [A] and lost.due(2.0, busy=()) == []
    assert lost.due(2.5, busy={A}) == []  # its fetch runs: no second one
    assert lost.due(2.6, busy=()) == [A]
    lost.lost(B, 3.0)
    why = lost.problem(4.0)
    assert (
        why
        == "no reachable prefill: 2 prefill(s) dropped for missed heartbeats, the first 4.0s ago (looked for every 1s)"
    )
    lost.found(A)
    assert lost.due(11.0, busy=()) == [B] and lost.problem(11.0) is not None
    assert lost.due(13.1, busy=()) == [] and lost.problem(13.1) is None  # B forgotten after 10 s


def test_at_most_max_lost_are_kept() -> None:
    lost = LostPrefills(retry_s=1.0, forget_s=10.0)
    for i in range(MAX_LOST + 5):
        lost.lost(BootstrapAddress(f"10.1.{i // 256}.{i % 256}", 8998), 0.0)
    assert len(lost.since) == MAX_LOST and len(lost.due(1.0, busy=())) == MAX_LOST
