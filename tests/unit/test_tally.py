"""The TP prefill's room tally (pure): a room is over only when every rank reported it, the
first failure is announced once and wins, a rank that exited fails its open and later rooms."""

from __future__ import annotations

import pytest

from kvpipe.disagg.tally import RoomTally
from kvpipe.transfer.lifecycle import TransferState

S, F = TransferState.SUCCESS, TransferState.FAILED


# ---- RoomTally -----------------------------------------------------------------------------
def test_tally_success_needs_every_rank() -> None:
    t = RoomTally(3)
    assert not t.add(7)
    assert not t.report(0, 7, S) and not t.report(2, 7, S)
    assert t.take_finished() == [] and t.pending_ranks(7) == [1]
    t.report(2, 7, F, "late")  # a repeated report changes nothing
    t.report(1, 7, S)
    assert t.take_finished() == [(7, S, "")] and 7 not in t and t.take_finished() == []


def test_tally_first_failure_is_announced_once_and_wins() -> None:
    t = RoomTally(2)
    t.add(1)
    assert t.report(1, 1, F, "write failed")  # first failure: the caller aborts the room elsewhere
    assert t.failure(1) == "prefill TP rank 1: write failed"
    assert not t.report(0, 1, F, "aborted")
    assert t.take_finished() == [(1, F, "prefill TP rank 1: write failed")]
    t.add(2)
    t.report(0, 2, S)
    assert t.report(1, 2, F, "x") and t.take_finished() == [(2, F, "prefill TP rank 1: x")]
    assert not t.report(0, 99, S)  # unknown rooms are ignored
    with pytest.raises(ValueError):
        t.report(0, 2, TransferState.TRANSFERRING)
    with pytest.raises(ValueError):
        t.report(2, 2, S)


def test_tally_gone_rank_fails_open_and_later_rooms() -> None:
    t = RoomTally(2)
    t.add(1)
    t.add(2)
    t.report(1, 2, S)  # room 2 was reported by rank 1 before it died: not failed by its death
    assert t.rank_gone(1, "exited") == [1] and t.rank_gone(1, "again") == []
    assert t.failure(2) is None
    assert t.add(3)  # added after the death: failed at once
    for room in (1, 2, 3):
        t.report(0, room, S)
    assert sorted(t.take_finished()) == [
        (1, F, "prefill TP rank 1: exited"),
        (2, S, ""),
        (3, F, "prefill TP rank 1: exited"),
    ]
