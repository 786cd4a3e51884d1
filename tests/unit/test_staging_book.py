"""Staging ring bookkeeping without threads, sockets or tensors: the decode agent (StagingBook:
grants, FIFO waits, validation, release, leases, watermark) and the prefill's staged chunks
(SenderBook: gather -> slot -> one write -> scatter ack before the final status)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.config import DisaggregationConfig, TransferTuning
from kvpipe.transfer.backends.base import BatchHandle, BatchState
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.lifecycle import TransferState as T
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import ChunkState, SendCall, StagingPolicy
from kvpipe.transfer.staging.book import StagingBook
from tests.helpers.registered import register_answered

L, PS, HD = 2, 4, 8
HEAD = PS * HD * 4  # bytes of one head of one float32 page
ROOM, P, AGENT = 1, "tcp://p", "tcp://agent"
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5,
    waiting_timeout_s=50,
    heartbeat_interval_s=1,
    heartbeat_misses=3,
    transfer_timeout_s=10,
    tuning=TransferTuning(max_inflight_ops=8),
)


def layout(base: int, heads: int = 2, start: int = 0, pages: int = 8) -> KVLayout:
    return KVLayout(
        L, PS, heads, start, 2, HD, "float32", 4, tuple(base + (i << 20) for i in range(2 * L)), pages * heads * HEAD
    )


# ---- decode side: StagingBook -------------------------------------------------------------------
DEC = layout(1 << 40)  # 8 pages of 256 bytes (2 heads)


def agent(capacity: int = 2048, lease_s: float = 5.0) -> StagingBook:
    return StagingBook(DEC, capacity, "d/0", lease_s)


def ask(book: StagingBook, chunk: int, nbytes: int = 1024, now: float = 0.0, session: str = "p/0"):
    return book.on_request(m.StagingSlotRequest(ROOM, session, chunk, nbytes, P), now)


def announce(
    book: StagingBook,
    chunk: int,
    pages=(0, 1),
    off: int = HEAD,
    sl: int = HEAD,
    layers=(0, L),
    room: int = ROOM,
    scatter: bool = True,
    now: float = 0.0,
):
    """Defaults: 2 layers x K/V x 2 pages x one head = the 1024 bytes `ask` reserves."""
    return book.on_written(m.StagingChunkWritten(room, chunk, "p/0", P, scatter, tuple(pages), off, sl, *layers), now)


def scatter(book: StagingBook, chunk: int, now: float = 0.0, **kw):
    job, out = announce(book, chunk, now=now, **kw)
    assert job is not None and out == []
    return book.scattered(job, None, now)


def grant(chunk: int, offset: int) -> tuple[str, m.StagingSlotGrant]:
    return P, m.StagingSlotGrant(ROOM, chunk, "d/0", True, offset)


def test_grant_from_an_empty_ring_and_refuse_a_second_request_for_the_chunk():
    b = agent()
    assert ask(b, 0) == [grant(0, 0)]
    [(addr, again)] = ask(b, 0)
    assert addr == P and not again.ok and "already has a slot" in again.reason
    assert ask(b, 0, session="p/1") == [grant(0, 1024)]  # chunk ids are per prefill session
    assert (b.stats.granted, b.stats.refused, b.ring.num_live) == (2, 1, 2)


def test_an_oversized_request_is_refused_at_once():
    b = agent()
    [(_, g)] = ask(b, 0, nbytes=2049)
    assert not g.ok and "larger than" in g.reason
    assert b.stats.refused == 1 and not b.waiting and b.ring.num_live == 0


# Regression: queued behind others, it reached the queue head and every grant after a free raised.
def test_an_oversized_request_is_refused_even_while_others_wait():
    b = agent()
    ask(b, 0, nbytes=2048)
    assert ask(b, 1) == [] and 1 in {k[1] for k in b.waiting}  # ring full: chunk 1 waits
    [(_, g)] = ask(b, 2, nbytes=4096)  # can never fit: must not queue (it would wedge the queue head)
    assert not g.ok and "larger than" in g.reason


def test_a_full_ring_grants_fifo_and_small_requests_do_not_jump_the_queue():
    b = agent()
    assert ask(b, 0) + ask(b, 1) == [grant(0, 0), grant(1, 1024)]
    assert ask(b, 2, nbytes=2048) == []  # the whole ring: waits
    [(_, done0)] = scatter(b, 0)  # frees [0, 1024): chunk 2 still does not fit
    assert done0.ok and list(b.waiting) == [("p/0", 2)]
    assert ask(b, 3, nbytes=256) == []  # would fit now, but chunk 2 asked first
    assert b.stats.waited == 2
    out = scatter(b, 1)  # ring empty: chunk 2 gets it all, chunk 3 still waits
    assert [msg for _, msg in out][1:] == [grant(2, 0)[1]] and list(b.waiting) == [("p/0", 3)]
    assert announce(b, 2, scatter=False) == (None, [grant(3, 0)])  # released: chunk 3 at last
    assert ask(b, 4, nbytes=2048) == [] and ask(b, 5, nbytes=256) == []  # 4 waits (3 holds 256 B), 5 behind it
    assert announce(b, 4, scatter=False) == (None, [grant(5, 256)])  # a queued release grants the next


def _check_rejects(kw: dict, why: str) -> None:
    b = agent()
    ask(b, 0)
    job, [(addr, done)] = announce(b, 0, **kw)
    assert job is None and addr == P
    assert (done.chunk, done.ok) == (0, False) and why in done.reason
    assert b.ring.num_live == 0 and not b.grants and b.stats.rejected == 1  # the slot is free again


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(pages=(0, 8)), "distinct ids in [0, 8)"),
        (dict(pages=(3, 3)), "distinct ids"),
        (dict(layers=(0, L + 1)), "layers [0, 3) outside"),
        (dict(layers=(1, 1)), "layers [1, 1) outside"),
        (dict(off=200), "bytes [200, 328) outside a 256-byte page"),
        (dict(pages=(0, 1, 2)), "1536 bytes announced for a 1024-byte slot"),
        (dict(room=ROOM + 1), "granted for room 1, announced for room 2"),
    ],
)
def test_announcements_are_validated_before_any_scatter(kw, why):
    _check_rejects(kw, why)


# Negative indices (the wire codec refuses them, the book must not rely on it): torch would index
# pages[-1] as the pool's last page and bytes [-2*HEAD:-HEAD] as head 0, someone else's KV.
def test_a_negative_page_id_is_rejected():
    _check_rejects(dict(pages=(-1, 0)), "distinct ids")


def test_a_negative_page_offset_is_rejected():
    _check_rejects(dict(off=-2 * HEAD), "outside a 256-byte page")


def test_an_announcement_without_a_slot_is_answered_not_ok():
    b = agent()
    job, [(_, done)] = announce(b, 7)
    assert job is None and not done.ok and "holds no slot" in done.reason and b.stats.rejected == 1


def test_release_frees_a_slot_or_a_place_in_the_queue_and_ignores_unknown_chunks():
    b = agent()
    ask(b, 0, nbytes=2048)
    ask(b, 1)
    assert announce(b, 1, scatter=False) == (None, [])  # queued: just leaves the queue
    assert not b.waiting and b.stats.released == 1
    assert announce(b, 0, scatter=False) == (None, [])  # granted: slot freed, no StagingChunkDone
    assert b.ring.num_live == 0 and not b.grants and b.stats.released == 2
    assert announce(b, 9, scatter=False) == (None, []) and b.stats.released == 2
    assert not announce(b, 0)[1][0][1].ok  # a released slot cannot be scattered any more


def test_leases_free_unannounced_slots_and_refuse_requests_queued_too_long():
    b = agent(lease_s=5.0)
    ask(b, 0, nbytes=2048, now=0.0)
    assert ask(b, 1, now=0.5) == []
    assert b.expire(5.0) == [] and b.ring.num_live == 1  # exactly lease_s: not yet
    assert b.expire(5.2) == [grant(1, 0)]  # chunk 0 never announced: freed; chunk 1 granted now
    assert b.stats.expired == 1 and not announce(b, 0)[1][0][1].ok
    ask(b, 2, nbytes=2048, now=6.0)  # waits behind chunk 1
    [(addr, refused)] = b.expire(11.5)  # chunk 1 (granted at 5.2) and chunk 2 (queued at 6.0) both expire
    assert addr == P and (refused.chunk, refused.ok) == (2, False) and "staging ring full for 5s" in refused.reason
    assert b.stats.expired == 3 and b.ring.num_live == 0 and not b.waiting


def test_done_carries_the_watermark_after_the_free():
    b = agent()
    ask(b, 0)
    ask(b, 1)
    [(_, d1)] = scatter(b, 1, pages=(2, 3))  # chunk 0 still holds the tail
    assert (d1.watermark_round, d1.watermark_offset) == b.ring.watermark == (0, 0)
    [(_, d0)] = scatter(b, 0)
    assert (d0.watermark_round, d0.watermark_offset) == b.ring.watermark == (0, 2048)
    assert ask(b, 2) == [grant(2, 0)]  # wraps to the base: round 1
    [(_, d2)] = announce(b, 2, pages=(0, 9))[1]  # a rejection frees too
    assert (d2.watermark_round, d2.watermark_offset) == b.ring.watermark == (1, 1024)


# ---- prefill side: SenderBook staged chunks ----------------------------------------------------
# Heterogeneous TP: prefill TP 2 rank 1 holds head 1, the decode (TP 1) holds heads 0 and 1, so
# each decode page gets bytes [HEAD, 2*HEAD): a sliced span, staged under mode "on". One
# destination keeps the message flow easy to follow; dst_col != 0 checks the page offset.
PRE, DPOOL = layout(1 << 30, heads=1, start=1, pages=64), layout(1 << 40, pages=64)
POOL, LOCAL = 1 << 44, 1 << 36  # decode ring / prefill staging buffer base addresses


class Staged:
    """A SenderBook sending room 1 (4 pages, 2 chunks of 2 pages) to decode "d/0" via its agent,
    played by a real StagingBook so the announcements are checked as the decode would."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.book = SenderBook(
            CFG,
            PRE,
            1,
            2,
            "p/0",
            lambda a, msg: self.sent.append((a, msg)) or True,
            control_address=P,
            staging=StagingPolicy("on", 1024, 4096),
            staging_addr=LOCAL,
        )
        self.agent = StagingBook(DPOOL, 4096, "d/0", lease_s=30.0)
        register_answered(
            self.book,
            m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", DPOOL, m.StagingInfo(AGENT, POOL, 4096, "d/0")),
            0.0,
        )
        assert self.take(m.RegisterReply)[0][1].state is m.RegisterState.ACCEPTED
        self.book.add_room(ROOM, np.arange(10, 14), 0.0)
        self.book.on_message(m.TransferRequest(ROOM, "d/0", (40, 41, 42, 43), 0, 0), 0.0)
        self.book.add_call(ROOM, SendCall(0, 16, 0, L, True), (5, -0.5))

    def take(self, kind) -> list:
        """Sent messages of one type (to the agent, or statuses to the decode), removed from `sent`."""
        out = [(a, msg) for a, msg in self.sent if isinstance(msg, kind)]
        self.sent = [x for x in self.sent if not isinstance(x[1], kind)]
        return out

    def to_agent(self, kind, now: float) -> list:
        """Deliver what the book sent the agent; the agent's answers come back."""
        answers = []
        for addr, msg in self.take(kind):
            assert addr == AGENT
            if kind is m.StagingSlotRequest:
                answers += self.agent.on_request(msg, now)
            else:
                job, out = self.agent.on_written(msg, now)
                answers += out + (self.agent.scattered(job, None, now) if job is not None else [])
        return answers

    def gather(self, now: float) -> list:
        """Plan, then the worker gathers every chunk handed out and reports back."""
        take, _, _ = self.book.take_work(now)
        assert take == []  # staged chunks are no page ops
        gathers = self.book.staged.take_gathers()
        assert self.book.staged.take_gathers() == []  # handed out once
        self.book.staged.gathered([(r, ch, None) for r, ch in gathers], now)
        return [ch for _, ch in gathers]

    def write(self, now: float) -> list:
        """One worker round in which every submitted batch lands."""
        take, _, _ = self.book.take_work(now)
        fresh = [(r, b, BatchHandle(i, b.peer, b.num_ops, int(b.length.sum())), None) for i, (r, b) in enumerate(take)]
        self.book.record(fresh, [], now)
        rooms = {id(r): r for r, *_ in fresh}.values()
        self.book.record([], [(r, inf, BatchState.DONE) for r in rooms for inf in list(r.inflight)], now)
        return take


def test_staged_chunks_gather_slot_write_scatter_then_the_status():
    s = Staged()
    r = s.book.rooms[ROOM]
    chunks = s.gather(1.0)
    assert not r.queued and sorted(r.staged) == sorted(ch.chunk for ch in chunks) and len(chunks) == 2
    assert [tuple(ch.dst_pages) for ch in chunks] == [(40, 41), (42, 43)]
    assert all(
        (ch.src_col, ch.dst_col, ch.ncols, ch.l0, ch.l1, ch.nbytes) == (0, HEAD, HEAD, 0, L, 1024) for ch in chunks
    )
    reqs = [msg for _, msg in s.sent]
    assert reqs == [m.StagingSlotRequest(ROOM, "p/0", ch.chunk, 1024, P, ch.nonce) for ch in chunks]
    assert len({ch.nonce for ch in chunks}) == 2  # random per chunk
    for _, g in s.to_agent(m.StagingSlotRequest, 1.1):
        s.book.on_message(g, 1.1)
    assert [ch.offset for ch in chunks] == [0, 1024]
    local = [LOCAL + ch.local.offset for ch in chunks]  # where each chunk was gathered
    take = s.write(2.0)
    assert [b.chunk for _, b in take] == chunks and all(b.num_ops == 1 and b.peer == "data-d" for _, b in take)
    assert [(int(b.src[0]), int(b.dst[0]), int(b.length[0])) for _, b in take] == [
        (local[0], POOL, 1024),
        (local[1], POOL + 1024, 1024),
    ]
    assert s.book.staged.local_ring.num_live == 0  # the bytes are on the decode: local staging is free
    written = [msg for _, msg in s.sent if isinstance(msg, m.StagingChunkWritten)]
    assert [(w.scatter, w.dst_pages, w.page_offset, w.slice_nbytes, w.layer_start, w.layer_end) for w in written] == [
        (True, (40, 41), HEAD, HEAD, 0, L),
        (True, (42, 43), HEAD, HEAD, 0, L),
    ]
    assert all(ch.state is ChunkState.WAIT_DONE for ch in chunks)
    s.book.take_work(3.0)
    assert s.take(m.TransferStatus) == [] and s.book.poll(3.0) == []  # no scatter confirmed yet
    done = s.to_agent(m.StagingChunkWritten, 3.5)  # the agent validates and scatters both
    assert [d.ok for _, d in done] == [True, True]
    s.book.on_message(done[0][1], 3.5)
    s.book.take_work(3.6)
    assert s.take(m.TransferStatus) == []  # one chunk still unconfirmed
    s.book.on_message(done[1][1], 3.7)
    s.book.take_work(3.8)
    [(addr, st)] = s.take(m.TransferStatus)
    assert addr == "tcp://d" and st.state is m.WireState.SUCCESS and st.aux == m.AuxData(ROOM, 5, -0.5)
    assert s.book.poll(3.8) == [(ROOM, T.SUCCESS, "")]
    assert (s.book.stats.staged_chunks, s.book.stats.staged_bytes) == (2, 2048) and s.agent.ring.num_live == 0


def test_an_aborted_room_releases_chunks_waiting_for_slots():
    s = Staged()
    c0, c1 = s.gather(1.0)
    [(_, g0), (_, g1)] = s.to_agent(m.StagingSlotRequest, 1.1)
    s.book.on_message(g0, 1.1)  # c0 granted, not yet written; c1's grant is still on the wire
    s.book.abort(ROOM, "client gone", 2.0)
    take, _, _ = s.book.take_work(2.1)
    assert take == []  # the granted chunk is never written
    released = [msg for _, msg in s.sent if isinstance(msg, m.StagingChunkWritten)]
    assert sorted((w.chunk, w.scatter) for w in released) == [(c0.chunk, False), (c1.chunk, False)]
    assert s.to_agent(m.StagingChunkWritten, 2.2) == [] and s.agent.ring.num_live == 0  # decode slots free
    s.book.on_message(g1, 2.3)  # late grant of a released chunk: ignored, not an error
    assert s.book.stats.rejected_messages == 0
    assert [msg.state for _, msg in s.take(m.TransferStatus)] == [m.WireState.FAILED]
    assert s.book.poll(2.3) == [(ROOM, T.FAILED, "client gone")]
    assert s.book.staged.local_ring.num_live == 0 and s.book.staged.local_ring.used_bytes == 0


def test_a_refused_grant_fails_the_room_with_the_agents_reason():
    s = Staged()
    c0, c1 = s.gather(1.0)
    s.take(m.StagingSlotRequest)
    why = "a staging chunk of 1024 bytes is larger than the 512-byte staging ring"
    s.book.on_message(m.StagingSlotGrant(ROOM, c0.chunk, "d/0", False, 0, why, c0.nonce), 1.5)
    s.book.take_work(1.6)
    released = [msg for _, msg in s.take(m.StagingChunkWritten)]
    assert [(w.chunk, w.scatter) for w in released] == [(c1.chunk, False)]  # c0 never had a slot
    [(_, st)] = s.take(m.TransferStatus)
    assert st.state is m.WireState.FAILED and why in st.reason
    [(room, state, reason)] = s.book.poll(1.6)
    assert (room, state) == (ROOM, T.FAILED) and "refused a staging slot" in reason and why in reason
    assert s.book.staged.local_ring.num_live == 0


def test_a_grant_past_the_decodes_ring_is_rejected_and_fails_the_room():
    s = Staged()
    c0, _ = s.gather(1.0)
    s.take(m.StagingSlotRequest)
    s.book.on_message(m.StagingSlotGrant(ROOM, c0.chunk, "d/0", True, 4096 - 512, "", c0.nonce), 1.5)  # at 3584
    assert s.book.stats.rejected_messages == 1
    s.book.take_work(1.6)
    assert s.take(m.TransferStatus)[0][1].state is m.WireState.FAILED
    [(room, state, reason)] = s.book.poll(1.6)
    assert (room, state) == (ROOM, T.FAILED) and "overruns the decode's 4096-byte ring" in reason
    assert s.book.staged.local_ring.num_live == 0


def test_a_forged_grant_or_done_is_refused_and_the_real_ones_finish_the_room():
    """Issue 30, finding 5: a grant or done counts only from the agent session the decode announced
    and with the chunk's nonce; forged ones change nothing, and both rings end empty."""
    s = Staged()
    c0, c1 = s.gather(1.0)
    forged = [
        m.StagingSlotGrant(ROOM, c0.chunk, "evil/0", True, 0, "", c0.nonce),  # another session
        m.StagingSlotGrant(ROOM, c0.chunk, "d/0", True, 0, "", c0.nonce ^ 1),  # the agent's session, no nonce
        m.StagingSlotGrant(ROOM, c1.chunk, "d/0", False, 0, "refused", 0),  # a refusal would fail the room
        m.StagingChunkDone(ROOM, c1.chunk, "d/0", True, nonce=c0.nonce),  # c0's nonce for c1
    ]
    for msg in forged:
        s.book.on_message(msg, 1.05)
    assert s.book.stats.foreign_rejected == len(forged) == s.book.stats.rejected_messages
    assert c0.state is c1.state is ChunkState.WAIT_SLOT and c0.offset is None
    assert s.book.rooms[ROOM].rec.state is not T.FAILED
    for _, g in s.to_agent(m.StagingSlotRequest, 1.1):
        s.book.on_message(g, 1.1)
    s.write(2.0)
    for _, done in s.to_agent(m.StagingChunkWritten, 3.0):
        s.book.on_message(done, 3.0)
    s.book.take_work(3.1)
    assert s.book.poll(3.1) == [(ROOM, T.SUCCESS, "")]
    assert s.book.rooms == {} and s.book.staged.local_ring.num_live == 0 and s.agent.ring.num_live == 0


def test_an_announcement_or_release_without_the_chunks_nonce_changes_nothing():
    """Issue 30, finding 5: the agent frees or scatters a slot only for the prefill that asked."""
    b = agent()
    [(_, g0)] = b.on_request(m.StagingSlotRequest(ROOM, "p/0", 0, 1024, P, 77), 0.0)
    assert g0.ok and g0.nonce == 77
    assert b.on_request(m.StagingSlotRequest(ROOM, "p/0", 1, 2048, P, 78), 0.0) == []  # waits
    forged = [
        m.StagingChunkWritten(ROOM, 0, "p/0", P, False, nonce=0),  # release the granted slot
        m.StagingChunkWritten(ROOM, 0, "p/0", "tcp://evil", True, (0, 1), HEAD, HEAD, 0, L, 5),  # scatter into it
        m.StagingChunkWritten(ROOM, 1, "p/0", P, False, nonce=0),  # drop the queued request
    ]
    assert all(b.on_written(msg, 0.1) == (None, []) for msg in forged)
    assert b.stats.foreign == len(forged) and b.ring.num_live == 1 and list(b.waiting) == [("p/0", 1)]
    job, out = b.on_written(m.StagingChunkWritten(ROOM, 0, "p/0", P, True, (0, 1), HEAD, HEAD, 0, L, 77), 0.2)
    assert job is not None and out == []
    [(_, done), (_, g1)] = b.scattered(job, None, 0.3)
    assert done.ok and done.nonce == 77 and g1.ok and g1.nonce == 78  # the queued request, granted now
    assert b.on_written(m.StagingChunkWritten(ROOM, 1, "p/0", P, False, nonce=78), 0.4) == (None, [])
    assert b.ring.num_live == 0 and not b.waiting and not b.grants


def test_staging_waits_are_capped_per_session():
    """Issue 30, finding 5: one prefill session cannot queue unbounded requests at a full ring."""
    b = StagingBook(DEC, 2048, "d/0", lease_s=5.0, max_waits=2)
    assert ask(b, 0, nbytes=2048)[0][1].ok  # the whole ring
    assert ask(b, 1) == [] and ask(b, 2) == []
    [(_, refused)] = ask(b, 3)
    assert not refused.ok and "2 chunks of this session" in refused.reason and b.stats.refused == 1
    assert ask(b, 4, session="p/1") == []  # another session queues behind them
    assert len(b.waiting) == 3
    for chunk, session in ((1, "p/0"), (2, "p/0"), (4, "p/1")):
        b.on_written(m.StagingChunkWritten(ROOM, chunk, session, P, False), 1.0)
    b.on_written(m.StagingChunkWritten(ROOM, 0, "p/0", P, False), 1.0)
    assert b.ring.num_live == 0 and not b.waiting and not b._waits


def test_each_grant_observes_how_long_its_request_queued():
    """kvpipe_staging_wait_seconds (waits.py): 0 for a grant at once, the queued time otherwise;
    a request released or expired while queued was never granted and observes nothing."""
    b = agent(lease_s=5.0)
    ask(b, 0, now=1.0)
    ask(b, 1, now=1.0)  # two grants at once
    assert ask(b, 2, nbytes=2048, now=1.5) == []  # queues from 1.5
    scatter(b, 0, now=2.0)
    out = scatter(b, 1, now=2.25)  # granted at 2.25: waited 0.75 s
    assert [msg for _, msg in out][1:] == [grant(2, 0)[1]]
    assert ask(b, 3, nbytes=256, now=3.0) == []  # queues behind chunk 2's whole-ring slot
    assert announce(b, 3, scatter=False, now=3.5) == (None, [])  # given up while queued
    w = b.waits
    assert w.count == b.stats.granted == 3
    assert w.total_s == 0.75
    assert w.counts[0] == 2  # le=0.001: the two at once
    assert w.counts[w.bounds.index(1.0)] == 1  # (0.5, 1.0]
