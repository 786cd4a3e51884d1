"""The TP prefill's room tally (pure) and the TPSender facade on rank 0: calls reach every child in
order (gated calls only once ready), a room is over only when every rank reported it, the first
failure aborts it everywhere, a child whose channel breaks fails its rooms. The children are the
test, speaking the agent protocol over real socketpairs; rank 0's sender is a real KVSender."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Connection
from typing import Iterator

import numpy as np
import pytest

from kvpipe.engine.tp_agent import AbortRoom, AddRoom, AgentFailed, CloseAgent, RoomsDone, SendKV
from kvpipe.engine.tp_sender import TPSender
from kvpipe.engine.tp_tally import RoomTally
from kvpipe.transfer.backends.local import LocalBackend
from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.sender import KVSender
from kvpipe.transfer.sender_book import SenderStats
from kvpipe.transfer.state import TransferState

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
    assert sorted(t.take_finished()) == [(1, F, "prefill TP rank 1: exited"), (2, S, ""),
                                         (3, F, "prefill TP rank 1: exited")]


# ---- TPSender ------------------------------------------------------------------------------
L, PS, HD, PAGES = 2, 4, 8, 32
CFG = DisaggregationConfig(bootstrap_timeout_s=5, waiting_timeout_s=50, heartbeat_interval_s=1, transfer_timeout_s=10)


def layout() -> KVLayout:  # rank 0 of TP 2 over 2 KV heads; addresses are never written here
    return KVLayout(L, PS, 1, 0, 2, HD, "float32", 4, tuple((1 << 30) + i * (1 << 20) for i in range(2 * L)),
                    PAGES * PS * HD * 4)


@pytest.fixture
def group() -> Iterator[tuple[TPSender, Connection]]:
    local = KVSender(CFG, layout=layout(), backend=LocalBackend(), tp_rank=0, tp_size=2, model_name="m",
                     instance_id="inst").start()
    mine, child = socket.socketpair()
    tp = TPSender(local, [Connection(mine.detach())])
    conn = Connection(child.detach())
    try:
        yield tp, conn
    finally:
        tp.close()
        conn.close()


def recv(conn: Connection, timeout_s: float = 5.0) -> object:
    assert conn.poll(timeout_s), "nothing forwarded to the child"
    return conn.recv()


def poll_until(tp: TPSender, n: int = 1, timeout_s: float = 5.0) -> list[tuple[int, TransferState, str]]:
    out: list = []
    end = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < end, f"only {out} after {timeout_s}s"
        out += tp.poll()
        time.sleep(0.005)
    return out


def test_calls_reach_the_child_in_order_and_the_room_waits_for_both(group) -> None:
    tp, child = group
    tp.add_room(5, np.arange(3))
    assert tp.send(5, 0, 8, 0, 1)
    tp.abort(5, "client gone")
    msgs = [recv(child) for _ in range(3)]
    assert isinstance(msgs[0], AddRoom) and msgs[0].room == 5 and msgs[0].pages.tolist() == [0, 1, 2]
    assert isinstance(msgs[1], SendKV) and (msgs[1].token_start, msgs[1].token_end, msgs[1].layer_end) == (0, 8, 1)
    assert msgs[2] == AbortRoom(5, "client gone")
    time.sleep(0.1)
    assert tp.poll() == [] and tp.num_active_rooms() == 1  # rank 0 is done, rank 1 is not
    assert tp.room_state(5) is F
    with pytest.raises(ValueError, match="still finishing on a TP rank"):
        tp.add_room(5, np.arange(3))
    child.send(RoomsDone(1, ((5, F, "aborted"),), SenderStats(bytes_written=123, ops_submitted=4)))
    assert poll_until(tp) == [(5, F, "prefill TP rank 0: client gone")]
    st = tp.stats
    assert (st.rooms_failed, st.rooms_succeeded, st.bytes_written, st.ops_submitted) == (1, 0, 123, 4)
    assert tp.num_active_rooms() == 0


def test_a_child_failure_aborts_the_room_on_rank_0(group) -> None:
    tp, child = group
    tp.add_room(6, np.arange(2))
    assert isinstance(recv(child), AddRoom)
    child.send(RoomsDone(1, ((6, F, "write to decode failed"),), SenderStats()))
    assert poll_until(tp) == [(6, F, "prefill TP rank 1: write to decode failed")]
    assert recv(child) == AbortRoom(6, "prefill TP rank 1: write to decode failed")


def test_rank_0_refusals_are_not_forwarded(group) -> None:
    tp, child = group
    tp.add_room(12, np.arange(2))
    assert isinstance(recv(child), AddRoom)
    with pytest.raises(ValueError):  # still active: DuplicateRoomError
        tp.add_room(12, np.arange(2))
    with pytest.raises(ValueError):  # pages outside the pool
        tp.add_room(13, np.array([PAGES]))
    with pytest.raises(KeyError):  # a send for a room rank 0 never had
        tp.send(14, 0, 4)
    assert not child.poll(0.1)


def test_gated_send_waits_for_ready(group) -> None:
    tp, child = group
    tp.add_room(8, np.arange(4))
    assert isinstance(recv(child), AddRoom)
    flag = {"ready": False}
    tp.send(8, 0, 8, 0, 1, ready=lambda: flag["ready"])
    tp.abort(8, "later")  # queued behind the gated call
    assert not child.poll(0.2)
    flag["ready"] = True
    assert isinstance(recv(child), SendKV) and isinstance(recv(child), AbortRoom)


def test_a_dead_child_fails_its_rooms_and_new_ones(group) -> None:
    tp, child = group
    tp.add_room(9, np.arange(2))
    assert isinstance(recv(child), AddRoom)
    child.close()  # the child process is gone
    out = poll_until(tp)
    assert out[0][:2] == (9, F) and "TP rank 1 exited" in out[0][2], out
    tp.add_room(10, np.arange(2))  # fails at once: rank 1 can never report it
    out = poll_until(tp)
    assert out[0][:2] == (10, F) and "TP rank 1" in out[0][2]


def test_an_agent_error_fails_the_rank(group) -> None:
    tp, child = group
    tp.add_room(11, np.arange(2))
    child.send(AgentFailed(1, "Traceback ...\nRuntimeError: boom"))
    out = poll_until(tp)
    assert out[0][:2] == (11, F) and "boom" in out[0][2]


def test_close_tells_children(group) -> None:
    tp, child = group
    tp.close()
    assert isinstance(recv(child), CloseAgent)
