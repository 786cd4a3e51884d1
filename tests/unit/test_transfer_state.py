"""Transfer state machine, deadlines and peer liveness with a fake clock (no sleeps)."""

from __future__ import annotations

import itertools

import pytest

from kvpipe.config import DisaggregationConfig, TransferTuning
from kvpipe.transfer.lifecycle import (
    PeerLiveness,
    RoomRecord,
    TransferState,
    advance,
    receiver_timeouts,
    sender_timeouts,
)

S = TransferState


def test_advance_only_forward_and_failed_wins():
    for cur, new in itertools.product(S, S):
        got = advance(cur, new)
        if S.FAILED in (cur, new):
            assert got is S.FAILED
        else:
            assert got is max(cur, new)
            assert got >= cur  # never backwards
    assert advance(S.SUCCESS, S.BOOTSTRAPPING) is S.SUCCESS
    assert advance(S.SUCCESS, S.FAILED) is S.FAILED
    assert advance(S.FAILED, S.SUCCESS) is S.FAILED
    assert [s.terminal for s in S] == [False, False, False, True, True]


def test_record_deadlines_follow_state():
    cfg = DisaggregationConfig(bootstrap_timeout_s=5, waiting_timeout_s=50)
    r = RoomRecord.new(7, receiver_timeouts(cfg), now=100.0)
    assert r.state is S.BOOTSTRAPPING and r.deadline == 105.0
    assert not r.expire(104.9)
    assert r.move(S.WAITING_FOR_INPUT, now=103.0)
    assert r.deadline == 153.0
    assert not r.move(S.BOOTSTRAPPING, now=104.0)  # backwards is ignored, deadline unchanged
    assert r.state is S.WAITING_FOR_INPUT and r.deadline == 153.0
    assert not r.expire(152.0)
    assert r.expire(153.0)
    assert r.state is S.FAILED and "waiting_for_input timed out" in r.reason
    assert r.deadline is None and r.finished_at == 153.0
    assert not r.expire(1e9)  # failing twice reports nothing new


def test_sender_waits_without_deadline_after_bootstrap():
    cfg = DisaggregationConfig(bootstrap_timeout_s=2)
    r = RoomRecord.new(1, sender_timeouts(cfg), now=0.0)
    assert r.expire(2.5) and "bootstrapping timed out" in r.reason
    r2 = RoomRecord.new(2, sender_timeouts(cfg), now=0.0)
    r2.move(S.WAITING_FOR_INPUT, now=1.0)
    assert r2.deadline is None and not r2.expire(1e6)


def test_first_failure_reason_wins_and_success_is_terminal():
    r = RoomRecord.new(3, receiver_timeouts(DisaggregationConfig()), now=0.0)
    assert r.fail("peer died", now=1.0)
    assert not r.fail("timeout", now=2.0)
    assert r.reason == "peer died" and r.finished_at == 1.0
    ok = RoomRecord.new(4, receiver_timeouts(DisaggregationConfig()), now=0.0)
    ok.move(S.SUCCESS, now=1.0)
    assert ok.deadline is None and not ok.expire(1e9) and ok.state is S.SUCCESS
    assert ok.fail("late abort", now=2.0) and ok.state is S.FAILED  # Failed wins over Success


def test_refresh_restarts_deadline():
    cfg = DisaggregationConfig(bootstrap_timeout_s=1, waiting_timeout_s=10)
    r = RoomRecord.new(5, receiver_timeouts(cfg), now=0.0)
    r.move(S.TRANSFERRING, now=0.5)
    r.refresh(now=9.0)
    assert not r.expire(18.9)
    assert r.expire(19.0)


def test_peer_liveness_reports_death_once_and_revival():
    lv = PeerLiveness(timeout_s=3.0)
    lv.track("a", now=0.0)
    lv.seen("b", now=1.0)
    lv.track("b", now=100.0)  # track does not overwrite a real sign of life
    assert lv.reap(now=3.0) == []
    assert lv.reap(now=3.5) == ["a"]
    assert lv.reap(now=3.6) == []  # reported once
    assert not lv.alive("a") and lv.alive("b")
    assert sorted(lv.reap(now=4.5)) == ["b"]
    assert lv.seen("a", now=5.0) is True  # came back
    assert lv.seen("a", now=5.1) is False
    assert lv.alive("a")
    lv.forget("a")
    assert not lv.alive("a") and lv.reap(now=1e9) == []


def test_peer_liveness_does_not_count_the_observers_own_pause():
    lv = PeerLiveness(timeout_s=3.0)
    lv.seen("a", now=0.0)
    lv.seen("b", now=0.0)
    lv.observed(0.0, pause_after_s=1.0)
    lv.observed(0.5, pause_after_s=1.0)  # a normal tick: nothing credited
    assert lv.last_seen == {"a": 0.0, "b": 0.0}
    # the observer's process was starved for 9.5 s (3x the timeout): its receive thread has not
    # read the heartbeats queued meanwhile, so that silence says nothing about the peers
    lv.observed(10.0, pause_after_s=1.0)
    assert lv.reap(10.0) == [] and lv.last_seen == {"a": 9.5, "b": 9.5}
    lv.seen("a", now=10.1)  # a's queued heartbeats arrive; b has really stopped
    lv.observed(10.2, pause_after_s=1.0)
    assert lv.reap(12.6) == ["b"]  # b: 3.1 s of silence the observer was awake for
    lv.seen("c", now=20.0)
    lv.observed(25.0, pause_after_s=1.0)
    assert lv.last_seen["c"] == 25.0  # credited up to now, never past it


def test_config_validation():
    with pytest.raises(ValueError):
        DisaggregationConfig(bootstrap_timeout_s=0)
    with pytest.raises(ValueError):
        TransferTuning(max_inflight_ops=0)
    assert DisaggregationConfig(heartbeat_interval_s=0.5, heartbeat_misses=4).heartbeat_timeout_s == 2.0
