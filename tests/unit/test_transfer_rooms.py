"""Sender/receiver bookkeeping without threads, sockets or memory: planning per send() call,
final-status rules, deadlines and liveness on a fake clock."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from kvpipe.config import ControlLimits, DisaggregationConfig, TransferTuning
from kvpipe.transfer.backends.base import BatchHandle, BatchState
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.lifecycle import DuplicateRoomError, RoomRecord, TransferState, receiver_timeouts, sender_timeouts
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.receiver.room import ReceiverRoom, rank_pairs
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.peers import expected_destinations
from kvpipe.transfer.sender.plan_types import Destination, PlanError, SendCall, equal_runs
from kvpipe.transfer.sender.room import SenderRoom
from tests.helpers.registered import register_answered

L, PS, HD, PAGES = 2, 4, 8, 64
T = TransferState
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5,
    waiting_timeout_s=50,
    heartbeat_interval_s=1,
    heartbeat_misses=3,
    transfer_timeout_s=10,
    tuning=TransferTuning(max_inflight_ops=8),
)


def layout(base: int, heads: int = 2, start: int = 0) -> KVLayout:
    page = heads * PS * HD * 4
    return KVLayout(
        L, PS, heads, start, 2, HD, "float32", 4, tuple(base + i * (1 << 20) for i in range(2 * L)), PAGES * page
    )


SRC, DST = layout(1 << 30), layout(1 << 40)


def room_with_dest(prefix: int, dst_pages) -> tuple[SenderRoom, Destination]:
    r = SenderRoom(1, RoomRecord.new(1, sender_timeouts(CFG), 0.0), SRC, src_pages=np.arange(10, 20), expected=1)
    d = Destination("d/0", 0, "tcp://d", "data-d", DST, np.asarray(dst_pages), prefix, (0, 2), np.full(L, prefix))
    r.dests[d.session_id] = d
    return r, d


def pages_of(r: SenderRoom) -> list[tuple[int, int, int]]:
    """(buffer, src page, dst page) of every planned op, one op per page (runs split)."""
    out = []
    pn = SRC.page_nbytes
    for b in r.queued:
        for s, d, n in zip(b.src, b.dst, b.length):
            buf = (int(s) - SRC.buffer_addrs[0]) >> 20
            s_page = (int(s) - SRC.buffer_addrs[buf]) // pn
            d_page = (int(d) - DST.buffer_addrs[buf]) // pn
            out += [(buf, s_page + i, d_page + i) for i in range(int(n) // pn)]
    r.queued.clear()
    return sorted(out)


def test_equal_runs():
    assert equal_runs(np.array([4, 4, 8, 8, 8, 4]), 0, 6) == [(0, 2, 4), (2, 5, 8), (5, 6, 4)]
    assert equal_runs(np.array([4, 4, 8]), 1, 3) == [(1, 2, 4), (2, 3, 8)]
    assert equal_runs(np.array([1]), 0, 0) == []


def test_chunks_skip_prefix_and_hold_back_partial_pages():
    r, d = room_with_dest(prefix=8, dst_pages=[40, 41, 30, 31])
    r.add_call(SendCall(0, 6, 0, L, False))
    assert r.plan(100) == 0  # inside the decode's prefix
    r.add_call(SendCall(6, 13, 0, L, False))
    assert pages_of(r) == [] and r.plan(100) == 4  # page 2 (tokens 8..11), K and V of 2 layers
    assert pages_of(r) == [(b, 12, 40) for b in range(4)]
    assert list(d.cursor) == [12, 12]
    r.add_call(SendCall(13, 22, 0, L, True))
    r.plan(100)
    assert pages_of(r) == sorted((b, 10 + p, dst) for b in range(4) for p, dst in ((3, 41), (4, 30), (5, 31)))
    with pytest.raises(PlanError, match="after the last chunk"):
        r.add_call(SendCall(22, 23, 0, L, True))


def test_last_call_flushes_every_layer_group():
    r, d = room_with_dest(prefix=0, dst_pages=np.arange(6))
    r.add_call(SendCall(0, 22, 0, 1, False))  # layer group 0: pages 0..4 full, page 5 partial
    r.plan(100)
    assert pages_of(r) == [(b, 10 + p, p) for b in (0, 1) for p in range(5)]
    r.add_call(SendCall(0, 22, 1, 2, True))  # last group: layer 1 all pages, layer 0 its page 5
    r.plan(100)
    assert pages_of(r) == sorted([(b, 15, 5) for b in (0, 1)] + [(b, 10 + p, p) for b in (2, 3) for p in range(6)])
    assert list(d.cursor) == [22, 22]


def test_plan_errors_and_batch_chunking():
    r, _ = room_with_dest(prefix=0, dst_pages=[1, 3])  # fragmented: one op per page and buffer
    r.add_call(SendCall(0, 8, 0, L, False))
    assert r.plan(3) == 8 and [b.num_ops for b in r.queued] == [3, 3, 2]
    r.add_call(SendCall(8, 16, 0, L, False))
    with pytest.raises(PlanError, match="gave 2 pages"):
        r.plan(3)
    r2, _ = room_with_dest(prefix=0, dst_pages=np.arange(20))
    with pytest.raises(PlanError, match="source pages"):
        r2.add_call(SendCall(0, 41, 0, L, False))  # 10 source pages hold 40 tokens
    with pytest.raises(PlanError, match="bad send range"):
        r2.add_call(SendCall(5, 4, 0, L, False))


class Book:
    """A SenderBook with registered decode session "d/0" and a list as its network."""

    def __init__(self, cfg=CFG):
        self.sent: list[tuple[str, object]] = []
        self.book = SenderBook(
            cfg, SRC, 0, 1, "p/0", lambda a, msg: self.sent.append((a, msg)) or True, own_data_address="data-p"
        )
        register_answered(self.book, m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", DST), 0.0)

    def statuses(self):
        out = [msg for _, msg in self.sent if isinstance(msg, m.TransferStatus)]
        self.sent.clear()
        return out

    def tick(self, now):
        """A worker round with nothing to submit or poll."""
        self.book.housekeeping(now)
        assert self.book.take_work(now) == ([], [], [])

    def run(self, now, state=BatchState.DONE):
        """One worker round: every submitted batch finishes with `state`."""
        take, cancels, watch = self.book.take_work(now)
        fresh = [(r, b, BatchHandle(i, b.peer, b.num_ops, 4 * b.num_ops), None) for i, (r, b) in enumerate(take)]
        self.book.record(fresh, [], now)
        polled = [(r, inf, state) for r in self.book.rooms.values() for inf in r.inflight]
        return self.book.record([], polled, now), cancels


def test_book_success_after_request_first():
    b = Book()
    b.book.on_message(m.TransferRequest(7, "d/0", tuple(range(6)), 0, 0), 1.0)  # before add_room
    assert b.book.rooms[7].rec.state is T.BOOTSTRAPPING
    b.book.add_room(7, np.arange(6), 2.0)
    with pytest.raises(DuplicateRoomError):
        b.book.add_room(7, np.arange(6), 2.0)
    assert b.book.rooms[7].rec.state is T.WAITING_FOR_INPUT
    b.book.add_call(7, SendCall(0, 22, 0, L, True), (5, -0.5))
    b.run(3.0)
    assert b.book.poll(3.0) == [(7, T.SUCCESS, "")]
    [st] = b.statuses()
    assert st.state is m.WireState.SUCCESS and st.aux == m.AuxData(7, 5, -0.5)
    b.book.on_message(m.Abort(7, "d/0", m.Side.DECODE, "late"), 4.0)  # crossed our status: ignored
    assert b.statuses() == [] and b.book.stats.rejected_messages == 0


def test_book_abort_waits_for_inflight_writes():
    b = Book()
    b.book.add_room(1, np.arange(6), 0.0)
    b.book.on_message(m.TransferRequest(1, "d/0", tuple(range(6)), 0, 0), 0.0)
    b.book.add_call(1, SendCall(0, 8, 0, L, False), None)
    take, _, _ = b.book.take_work(0.1)
    b.book.record([(r, bt, BatchHandle(1, bt.peer, bt.num_ops, 64), None) for r, bt in take], [], 0.1)
    b.book.on_message(m.Abort(1, "d/0", m.Side.DECODE, "client gone"), 0.2)
    take, cancels, watch = b.book.take_work(0.3)
    assert take == [] and len(cancels) == len(watch) == 2  # 4 ops in batches of max_inflight_ops // 4
    assert b.book.rooms[1].queued == collections.deque()  # nothing more is issued
    b.book.record([], [(r, inf, BatchState.DONE) for r, inf in watch[:1]], 0.35)
    assert b.book.poll(0.35) == [] and b.statuses() == []  # a write is still in flight
    b.book.record([], [(watch[1][0], watch[1][1], BatchState.FAILED)], 0.4)
    assert b.book.poll(0.4) == [(1, T.FAILED, "aborted by decode: client gone")]
    [st] = b.statuses()
    assert st.state is m.WireState.FAILED and b.book.inflight_ops == 0


def test_book_rejects_bad_requests_with_a_reason():
    b = Book()
    b.book.on_message(m.TransferRequest(1, "d/0", (1, 1), 0, 0), 0.0)
    b.book.on_message(m.TransferRequest(2, "d/0", (PAGES,), 0, 0), 0.0)
    b.book.on_message(m.TransferRequest(3, "d/0", (1,), 3, 0), 0.0)
    b.book.on_message(m.TransferRequest(4, "stranger", (1,), 0, 0), 0.0)  # nowhere to answer
    register_answered(b.book, m.RegisterPeer("d/8", 0, 1, "x", "tcp://x", layout(1 << 41, heads=1)), 0.0)
    b.book.on_message(m.TransferRequest(5, "d/8", (1,), 0, 0), 0.0)
    other = KVLayout(L, PS, 2, 0, 2, HD, "bfloat16", 2, layout(1 << 42).buffer_addrs, PAGES * 2 * PS * HD * 2)
    register_answered(b.book, m.RegisterPeer("d/9", 0, 1, "y", "tcp://y", other), 0.0)
    b.book.on_message(m.TransferRequest(6, "d/9", (1,), 0, 0), 0.0)
    reasons = {st.room: st.reason for st in b.statuses()}
    assert "duplicate destination pages" in reasons[1]
    assert f"outside the decode pool of {PAGES}" in reasons[2]
    assert "not a multiple of the page size" in reasons[3]
    assert 4 not in reasons and "holds KV heads [0, 1), TP 1 rank 0 needs [0, 2)" in reasons[5]
    assert "KV dtype mismatch" in reasons[6]
    assert b.book.stats.rejected_messages == 8
    b.book.add_room(1, np.arange(6), 1.0)  # its decode was refused: fail at once
    b.tick(1.0)
    assert b.book.poll(1.0)[0][1] is T.FAILED and b.statuses() == []


def test_book_deadlines_and_dead_decode():
    b = Book()
    b.book.add_room(1, np.arange(6), 0.0)
    b.tick(4.9)
    assert b.book.poll(4.9) == []
    b.tick(5.0)
    assert "bootstrapping timed out" in b.book.poll(5.0)[0][2]
    b.book.add_room(2, np.arange(6), 5.0)
    b.book.on_message(m.TransferRequest(2, "d/0", tuple(range(6)), 0, 0), 5.0)
    b.book.on_message(m.Heartbeat("d/0", 1), 5.5)
    b.tick(8.4)
    assert b.book.rooms[2].rec.state is T.WAITING_FOR_INPUT  # no deadline while computing
    b.tick(8.6)  # silent for 3.1 s > 3 misses * 1 s
    room, state, reason = b.book.poll(8.6)[0]
    assert (room, state) == (2, T.FAILED) and "heartbeats missed" in reason
    assert not any(isinstance(msg, m.Heartbeat) for _, msg in b.sent)  # the worker's ticks send none
    b.book.heartbeats(8.6)  # the pulse thread's call: one beat to the (dead, not yet forgotten) decode
    assert [msg for _, msg in b.sent if isinstance(msg, m.Heartbeat)] == [m.Heartbeat(b.book.session_id, 0)]


def test_rank_pairs_and_expected_destinations():
    assert rank_pairs(1, 2) == [(0, 0), (0, 1)]
    assert rank_pairs(4, 2) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [expected_destinations(0, 1, d) for d in (1, 2, 4)] == [1, 2, 4]
    assert [expected_destinations(p, 4, 1) for p in range(4)] == [1, 1, 1, 1]
    # every pair is counted once on each side
    for p_tp, d_tp in ((1, 4), (4, 1), (2, 4), (4, 2), (2, 2)):
        assert sum(expected_destinations(p, p_tp, d_tp) for p in range(p_tp)) == len(rank_pairs(p_tp, d_tp))


def status(room, ok=True, aux_room=None, token=1):
    aux = m.AuxData(room if aux_room is None else aux_room, token, -0.1) if ok else None
    return m.TransferStatus(room, "d/0", m.WireState.SUCCESS if ok else m.WireState.FAILED, "", aux)


def recv_room(p_tp=2, d_tp=1) -> ReceiverRoom:
    r = ReceiverRoom(3, RoomRecord.new(3, receiver_timeouts(CFG), 0.0), ("h", 1), (np.arange(4),) * d_tp, 0)
    r.requested_from("inst", p_tp, d_tp, tuple(f"d/{i}" for i in range(d_tp)))
    return r


def test_receiver_room_needs_every_prefill_rank():
    r = recv_room(p_tp=2)
    assert not r.quiet(1.0)
    assert r.on_status(0, 0, status(3), 1.0) is None and r.rec.state is T.TRANSFERRING
    assert r.on_status(0, 1, status(3), 2.0) is None and r.rec.state is T.SUCCESS
    assert r.aux == m.AuxData(3, 1, -0.1) and r.quiet(2.0)
    assert "a second final status from prefill rank 1" in r.on_status(0, 1, status(3), 3.0)
    # only the pairs the room was requested from answer: our session of that rank, a paired prefill rank
    assert r.pair_of("d/0", "inst/1") == (0, 1) and r.pair_of("d/0", "inst/0") == (0, 0)
    assert r.pair_of("d/1", "inst/0") is None and r.pair_of("d/0", "other/0") is None
    assert r.pair_of("d/0", "inst/2") is None and r.pair_of("inst/0", "d/0") is None


def test_receiver_room_stale_aux_and_quiet_rules():
    r = recv_room(p_tp=2)
    r.on_status(0, 0, status(3, aux_room=4), 1.0)
    assert r.rec.state is T.FAILED and "aux data of room 4" in r.rec.reason
    assert not r.quiet(1.0)  # the other prefill rank may still write
    r.quiet_deadline = 11.0
    assert not r.quiet(10.9) and r.quiet(11.0)
    r2 = recv_room(p_tp=2)
    r2.on_status(0, 0, status(3, token=1), 1.0)
    r2.on_status(0, 1, status(3, token=2), 1.0)
    assert r2.rec.state is T.FAILED and "disagree" in r2.rec.reason and r2.quiet(1.0)
    r3 = recv_room(p_tp=1)
    r3.on_status(0, 0, status(3, ok=False), 1.0)
    assert r3.rec.state is T.FAILED and r3.quiet(1.0)
    unrequested = ReceiverRoom(4, RoomRecord.new(4, receiver_timeouts(CFG), 0.0), ("h", 1), (np.arange(4),), 0)
    assert unrequested.quiet(0.0)


def test_book_stalled_writes_fail_the_room_and_are_abandoned_later():
    b = Book()
    b.book.add_room(1, np.arange(6), 0.0)
    b.book.on_message(m.TransferRequest(1, "d/0", tuple(range(6)), 0, 0), 0.0)
    b.book.add_call(1, SendCall(0, 22, 0, L, True), (1, 0.0))
    take, _, _ = b.book.take_work(0.0)
    b.book.record([(r, bt, BatchHandle(i, bt.peer, bt.num_ops, 64), None) for i, (r, bt) in enumerate(take)], [], 0.0)
    _, cancels, watch = b.book.take_work(9.9)
    assert cancels == [] and b.book.rooms[1].rec.state is T.TRANSFERRING
    b.book.record([], [(watch[0][0], watch[0][1], BatchState.DONE)], 9.9)  # progress restarts the clock
    _, cancels, watch = b.book.take_work(19.0)
    assert cancels == [] and len(watch) == len(take) - 1
    _, cancels, watch = b.book.take_work(20.0)
    assert len(cancels) == len(watch) and "made no progress for 10.1s" in b.book.rooms[1].rec.reason
    b.book.record([], [(r, inf, BatchState.PENDING) for r, inf in watch], 19.99)
    assert b.book.poll(20.0) == []  # still pending: pages stay reserved
    b.book.record([], [(r, inf, BatchState.PENDING) for r, inf in watch], 20.01)  # 2 * timeout: abandoned
    assert b.book.poll(20.01)[0][1] is T.FAILED and b.book.inflight_ops == 0


def test_book_abort_before_the_request_fails_the_room_at_once():
    """The decode gave up on a request before asking for its KV (it waited for pages): the
    prefill frees the room now instead of at its bootstrap timeout, and tells it nothing was written."""
    b = Book()
    b.book.add_room(3, np.arange(6), 0.0)
    b.book.add_call(3, SendCall(0, 22, 0, L, True), (5, -0.5))  # computed, waiting for the request
    b.book.on_message(m.Abort(3, "d/0", m.Side.DECODE, "client gone"), 1.0)
    b.tick(1.0)
    assert b.book.poll(1.0) == [(3, T.FAILED, "aborted by decode before its request: client gone")]
    [st] = b.statuses()
    assert st.state is m.WireState.FAILED and "never wrote room 3" in st.reason
    assert b.book.stats.rejected_messages == 0
    # a room another session asked for is not theirs to abort
    register_answered(b.book, m.RegisterPeer("e/0", 0, 1, "data-e", "tcp://e", DST), 2.0)
    b.book.add_room(4, np.arange(6), 2.0)
    b.book.on_message(m.TransferRequest(4, "d/0", tuple(range(6)), 0, 0), 2.0)
    b.book.on_message(m.Abort(4, "e/0", m.Side.DECODE, "not yours"), 2.1)
    assert b.book.rooms[4].rec.state is T.WAITING_FOR_INPUT and b.book.stats.rejected_messages == 1


def test_register_peer_cannot_rebind_a_session_or_point_writes_at_another_decodes_memory():
    """Issue 30, finding 5: RegisterPeer with someone else's data address or buffers is refused;
    the decode that registered first keeps its binding and its room's writes."""
    b = Book()  # "d/0": data "data-d", control "tcp://d", buffers DST; this rank's own data address "data-p"
    bound = b.book.peers.peers["d/0"]
    page = 2 * PS * HD * 4
    overlapping = KVLayout(
        L, PS, 2, 0, 2, HD, "float32", 4, tuple((1 << 41) + i * 4096 for i in range(2 * L)), PAGES * page
    )
    attempts = [
        m.RegisterPeer("d/0", 0, 1, "data-evil", "tcp://d", DST),  # rebind a bound session
        m.RegisterPeer("e/0", 0, 1, "data-d", "tcp://evil", DST),  # another decode's data address
        m.RegisterPeer("e/1", 0, 1, "data-d", "tcp://d", layout(1 << 41)),  # its address, other offsets
        m.RegisterPeer("e/2", 0, 1, "data-p", "tcp://evil", DST),  # this prefill rank's own memory
        m.RegisterPeer("e/3", 0, 1, "10.0.0.9:15000", "tcp://10.0.0.2:5555", DST),  # data on another host
        m.RegisterPeer("e/4", 0, 1, "10.0.0.2:15000", "tcp://10.0.0.2:5555", overlapping),
    ]
    for msg in attempts:
        register_answered(b.book, msg, 0.5)
    assert b.book.peers.peers == {"d/0": bound} and b.book.stats.rejected_messages == len(attempts)
    b.book.on_message(m.TransferRequest(1, "e/0", (1, 2), 0, 0), 0.6)  # answered with the reason, never written
    [st] = b.statuses()
    assert st.state is m.WireState.FAILED and "registered by the decode at tcp://d" in st.reason
    b.book.on_message(m.TransferRequest(2, "e/4", (1, 2), 0, 0), 0.6)
    assert "overlap" in b.statuses()[0].reason
    # the first registrant's room goes where it said, and everything is released afterwards
    b.book.add_room(3, np.arange(6), 1.0)
    b.book.on_message(m.TransferRequest(3, "d/0", tuple(range(6)), 0, 0), 1.0)
    b.book.add_call(3, SendCall(0, 22, 0, L, True), (5, -0.5))
    take, _, _ = b.book.take_work(1.1)
    lo, hi = min(DST.buffer_addrs), max(DST.buffer_addrs) + DST.buffer_nbytes
    assert take and all(bt.peer == "data-d" and lo <= bt.dst.min() and bt.dst.max() < hi for _, bt in take)
    b.book.record([(r, bt, BatchHandle(i, bt.peer, bt.num_ops, 64), None) for i, (r, bt) in enumerate(take)], [], 1.1)
    b.book.record([], [(r, inf, BatchState.DONE) for r in b.book.rooms.values() for inf in list(r.inflight)], 1.2)
    assert b.book.poll(1.2) == [(3, T.SUCCESS, "")] and b.book.rooms == {} and b.book.inflight_ops == 0


def test_orphan_rooms_and_tombstones_are_capped_per_session():
    """Issue 30, finding 5: a decode session cannot make a prefill rank hold unbounded rooms it
    requested ahead of the engine, nor unbounded tombstones; another session keeps its own."""
    cfg = dataclasses.replace(CFG, limits=ControlLimits(max_orphan_rooms_per_session=3, max_tombstones_per_session=2))
    b = Book(cfg)
    register_answered(b.book, m.RegisterPeer("e/0", 0, 1, "data-e", "tcp://e", layout(1 << 41)), 0.0)
    for room in range(5):
        b.book.on_message(m.TransferRequest(room, "d/0", (room,), 0, 0), 0.1)
    reasons = {st.room: st.reason for st in b.statuses()}
    assert sorted(reasons) == [3, 4] and "--disaggregation-max-orphan-rooms 3" in reasons[3]
    assert b.book.stats.orphans_refused == 2 and sorted(b.book.rooms) == [0, 1, 2]
    b.book.on_message(m.TransferRequest(9, "e/0", (1,), 0, 0), 0.1)  # another session: its own bound
    b.book.add_room(0, np.arange(6), 0.2)  # the engine admits room 0: it is no orphan any more
    b.book.on_message(m.TransferRequest(5, "d/0", (5,), 0, 0), 0.3)
    assert 5 in b.book.rooms and b.statuses() == []
    # tombstones: the refusals of rooms 3 and 4, then aborts of rooms it never asked for
    b.book.on_message(m.Abort(9, "e/0", m.Side.DECODE, "gone"), 0.3)  # e/0's own room: a failure, no tombstone
    for room in (10, 11, 12):
        b.book.on_message(m.Abort(room, "d/0", m.Side.DECODE, "gone"), 0.4)
    assert b.book.stats.tombstones_evicted == 3 and sorted(b.book.tombstones) == [11, 12]
    # everything ends: orphans time out, the admitted room is aborted; all released, bounds hold
    b.book.abort(0, "done", 1.0)
    for now in (1.0, 60.0):
        b.tick(now)
    assert [room for room, *_ in b.book.poll(60.0)] == [0]
    assert b.book.rooms == {} and len(b.book.orphans) == 0
    assert len([t for t in b.book.tombstones.values() if t.by == "d/0"]) <= 2
