"""Sliding-window layers in the transfer layer: plan_pages over explicit layer ids, sender rooms
that plan full layers over every page and sliding layers over the window pages the decode asked
for (aliased buffers, chunked sends, layer groups; below the decode's prefix too, once per layer),
request validation, protocol round trip."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import DisaggregationConfig, TransferTuning
from kvpipe.disagg.setup import register_pool
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import PrefillRankInfo
from kvpipe.transfer.control.codec import ProtocolError
from kvpipe.transfer.control.messages import StagingInfo
from kvpipe.transfer.lifecycle import RoomRecord, TransferState, sender_timeouts
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import plan_pages
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import Destination, PlanError, SendCall, StagingPolicy
from kvpipe.transfer.sender.room import SenderRoom
from tests.helpers.registered import register_answered

L, PS, HD, PAGES = 4, 4, 8, 64
SWA = (1, 3)  # GPT-OSS style: sliding and full layers alternate
FULL = (0, 2)
CFG = DisaggregationConfig(
    bootstrap_timeout_s=5,
    waiting_timeout_s=50,
    heartbeat_interval_s=1,
    heartbeat_misses=3,
    transfer_timeout_s=10,
    tuning=TransferTuning(max_inflight_ops=1 << 20),
)


def layout(base: int, heads: int = 2, start: int = 0, swa: tuple[int, ...] = SWA, alias: bool = True) -> KVLayout:
    """Sliding layer 2i+1 aliases full layer 2i's K and V tensors (alias=True), as the engine's pool does."""
    page = heads * PS * HD * 4
    addrs = []
    for layer in range(L):
        tensor = (layer // 2) * 2 if alias else 2 * layer  # first of the layer's two (K, V) tensors
        addrs += [base + tensor * (1 << 20), base + (tensor + 1) * (1 << 20)]
    return KVLayout(L, PS, heads, start, 2, HD, "float32", 4, tuple(addrs), PAGES * page, swa_layers=swa)


SRC, DST = layout(1 << 30), layout(1 << 40)


def expected_writes(src_l: KVLayout, dst_l: KVLayout, layers, src_pages, dst_pages) -> list[tuple[int, int]]:
    """(src address, dst address) of every page written: per layer, K and V, per page pair."""
    sp, dp = src_l.page_nbytes, dst_l.page_nbytes
    return [
        (src_l.buffer_addrs[2 * layer + kv] + int(s) * sp, dst_l.buffer_addrs[2 * layer + kv] + int(d) * dp)
        for layer in layers
        for kv in (0, 1)
        for s, d in zip(src_pages, dst_pages)
    ]


def writes_of(src, dst, length, pn: int = SRC.page_nbytes) -> list[tuple[int, int]]:
    """Ops split into whole pages: (src address, dst address) per page."""
    out = []
    for s, d, n in zip(src, dst, length):
        assert n % pn == 0
        out += [(int(s) + i * pn, int(d) + i * pn) for i in range(int(n) // pn)]
    return out


def planned(r: SenderRoom) -> list[tuple[int, int]]:
    out = []
    for b in r.queued:
        out += writes_of(b.src, b.dst, b.length)
    r.queued.clear()
    return out


# ---- plan_pages(layer_ids=) -----------------------------------------------------------------------


def test_plan_pages_layer_ids_matches_per_layer_plans():
    src, dst = layout(1 << 30, alias=False), layout(1 << 40, alias=False)
    s, d = np.array([3, 4, 5, 9]), np.array([7, 8, 20, 21])
    p = plan_pages(s, d, src, dst, layer_ids=np.array(SWA))
    parts = [plan_pages(s, d, src, dst, layers=(i, i + 1)) for i in SWA]
    assert np.array_equal(p.src_addr, np.concatenate([q.src_addr for q in parts]))
    assert np.array_equal(p.dst_addr, np.concatenate([q.dst_addr for q in parts]))
    assert np.array_equal(p.length, np.concatenate([q.length for q in parts]))
    assert (p.num_runs, p.num_ops, p.layer_start, p.layer_end) == (3, len(SWA) * 2 * 3, 1, 4)
    # a layer-group slice of an id plan: the planned layers inside it
    sub = p.layers(2, 4)
    assert np.array_equal(sub.src_addr, parts[1].src_addr) and sub.layer_ids.tolist() == [3]
    assert p.layers(2, 3).num_ops == 0  # a full layer: not in this plan
    # all layers as ids == the default plan, op for op
    every, default = plan_pages(s, d, src, dst, layer_ids=np.arange(L)), plan_pages(s, d, src, dst)
    for a, b in (
        (every.src_addr, default.src_addr),
        (every.dst_addr, default.dst_addr),
        (every.length, default.length),
    ):
        assert np.array_equal(a, b)
    assert plan_pages(s, d, src, dst, layer_ids=[]).num_ops == 0


@pytest.mark.parametrize("ids", [[3, 1], [1, 1], [0, L], [-1, 2]])
def test_plan_pages_refuses_bad_layer_ids(ids):
    with pytest.raises(ValueError, match="layer ids must increase"):
        plan_pages([1], [2], SRC, DST, layer_ids=ids)


def test_plan_pages_refuses_layers_and_layer_ids_together():
    with pytest.raises(ValueError, match="not both"):
        plan_pages([1], [2], SRC, DST, layers=(0, 1), layer_ids=[1])


def test_plan_pages_layer_ids_head_sliced():
    """Heterogeneous TP: one op per (layer, K/V, page), the head slice of each page."""
    dst = layout(1 << 40, heads=1, start=1)
    p = plan_pages([3, 4], [7, 9], SRC, dst, heads=(1, 2), layer_ids=[1, 3])
    assert p.num_ops == 2 * 2 * 2 and set(p.length.tolist()) == {SRC.head_nbytes}
    assert int(p.src_addr[0]) == SRC.buffer_addrs[2] + 3 * SRC.page_nbytes + SRC.head_nbytes
    assert int(p.dst_addr[0]) == dst.buffer_addrs[2] + 7 * dst.page_nbytes


# ---- layout ----------------------------------------------------------------------------------


def test_layout_swa_layers_validated_compared_and_aliases_registered_once():
    with pytest.raises(ValueError, match="must increase"):
        layout(0, swa=(3, 1))
    with pytest.raises(ValueError, match="must increase"):
        layout(0, swa=(1, L))
    assert "sliding-window layers mismatch: (1, 3) here vs (1,) on the peer" in SRC.compatible_with(
        layout(1 << 40, swa=(1,))
    )
    assert SRC.compatible_with(DST) is None and SRC.swa_mask == (False, True, False, True)
    assert SRC.aliased and not layout(0, alias=False).aliased
    addrs, sizes = SRC.unique_buffers()
    assert addrs == [(1 << 30) + i * (1 << 20) for i in range(4)] and sizes == [SRC.buffer_nbytes] * 4

    class Recorder:
        def __init__(self):
            self.calls = []

        def register_many(self, addrs, sizes):
            self.calls.append((list(addrs), list(sizes)))

    rec = Recorder()
    register_pool(rec, SRC)
    assert rec.calls == [(addrs, sizes)]  # 4 distinct tensors, not 8 buffers


def test_layout_from_pool_takes_swa_layers_and_aliases():
    pool = KVPool(L, 8, PS, 2, HD)
    for i in SWA:
        pool.k[i], pool.v[i] = pool.k[i - 1], pool.v[i - 1]
    pool.swa_layers = SWA
    lay = KVLayout.from_pool(pool)
    assert lay.swa_layers == SWA and lay.aliased and len(lay.unique_buffers()[0]) == 4
    assert KVLayout.from_pool(KVPool(L, 8, PS, 2, HD)).swa_layers == ()


# ---- sender rooms --------------------------------------------------------------------------------

# A 22-token prompt (6 pages), window W = 8: the decode wants sliding pages for logical pages
# [w0, 6), w0 = (22 - 8 + 1) // 4 = 3.
SRC_PAGES = np.arange(10, 16)
SRC_SWA = np.array([-1, -1, -1, 30, 31, 32])


def room(
    src_swa=SRC_SWA, prefix: int = 0, dst_swa=None, dst_pages=None, heads=(0, 2), dst_layout: KVLayout = DST
) -> tuple[SenderRoom, Destination]:
    first = prefix // PS
    dst_pages = np.arange(20, 26)[first:] if dst_pages is None else np.asarray(dst_pages)
    dst_swa = np.array([-1, -1, -1, 40, 41, 42])[first:] if dst_swa is None else np.asarray(dst_swa)
    r = SenderRoom(
        1,
        RoomRecord.new(1, sender_timeouts(CFG), 0.0),
        SRC,
        src_pages=SRC_PAGES,
        expected=1,
        src_swa_pages=None if src_swa is None else np.asarray(src_swa),
    )
    d = Destination(
        "d/0", 0, "tcp://d", "data-d", dst_layout, dst_pages, prefix, heads, np.full(L, prefix), dst_swa_pages=dst_swa
    )
    r.dests[d.session_id] = d
    return r, d


def test_room_moves_full_layers_whole_and_sliding_layers_in_the_window():
    r, _ = room()
    r.add_call(SendCall(0, 22, 0, L, True))
    r.plan(1 << 20)
    got = planned(r)
    want = expected_writes(SRC, DST, FULL, SRC_PAGES, np.arange(20, 26)) + expected_writes(
        SRC, DST, SWA, [30, 31, 32], [40, 41, 42]
    )
    assert sorted(got) == sorted(want) and len(set(got)) == len(got)
    # bytes: full layers x all pages + sliding layers x requested pages, K and V each
    assert len(got) * SRC.page_nbytes == (len(FULL) * 6 + len(SWA) * 3) * 2 * SRC.page_nbytes
    # coalesced: one run per (layer, K/V) for full layers (consecutive on both sides), same for sliding
    assert r.ops_planned == (len(FULL) + len(SWA)) * 2


def test_room_with_decode_prefix_and_scattered_window_pages():
    """Decode holds 8 tokens; it wants sliding pages 3 and 5 only (4 it got elsewhere, say)."""
    r, _ = room(prefix=8, dst_swa=[-1, 41, -1, 43])
    r.add_call(SendCall(0, 22, 0, L, True))
    r.plan(1 << 20)
    want = expected_writes(SRC, DST, FULL, SRC_PAGES[2:], np.arange(22, 26)) + expected_writes(
        SRC, DST, SWA, [30, 32], [41, 43]
    )
    assert sorted(planned(r)) == sorted(want)


def test_room_refuses_a_window_page_the_prefill_does_not_hold():
    r, _ = room(src_swa=[-1, -1, -1, -1, 31, 32])  # page 3 slid out on the prefill: its window is smaller
    r.add_call(SendCall(0, 22, 0, L, True))
    with pytest.raises(PlanError, match="prefill holds no sliding-window page for logical page 3"):
        r.plan(1 << 20)
    r, _ = room(src_swa=[-1, -1, -1, 30])  # window table shorter than the prompt: pages 4, 5 not allocated
    r.add_call(SendCall(0, 22, 0, L, True))
    with pytest.raises(PlanError, match="logical page 4"):
        r.plan(1 << 20)
    r, d = room()
    d.dst_swa_pages = None
    r.add_call(SendCall(0, 22, 0, L, True))
    with pytest.raises(PlanError, match="named no sliding-window pages"):
        r.plan(1 << 20)


def test_chunked_sends_with_layer_groups_move_each_window_page_once():
    """Chunked prefill with layer groups: the prefill's window table changes between chunks
    (pages slide out, -1); each page of every layer is planned exactly once."""
    r, d = room(src_swa=[-1, -1, 50, 51])  # after chunk 1 (16 tokens): pages 0, 1 slid out already
    r.src_pages = SRC_PAGES[:4]
    got = []
    r.add_call(SendCall(0, 16, 0, 2, False))  # layer group [0, 2): full 0, sliding 1
    r.plan(1 << 20)
    first = planned(r)
    # full layer 0: pages 0..3; sliding layer 1: page 3 only (0..2 are -1 on the decode)
    assert sorted(first) == sorted(
        expected_writes(SRC, DST, (0,), SRC_PAGES[:4], np.arange(20, 24)) + expected_writes(SRC, DST, (1,), [51], [40])
    )
    assert d.cursor.tolist() == [16, 16, 0, 0]
    got += first
    r.add_call(SendCall(0, 16, 2, 4, False))  # layer group [2, 4)
    r.plan(1 << 20)
    got += planned(r)
    assert d.cursor.tolist() == [16] * L
    # chunk 2 (the last): a newer window table, page 2 slid out; pages 4, 5 new
    r.src_pages, r.src_swa_pages = SRC_PAGES, np.array([-1, -1, -1, 51, 52, 53])
    r.add_call(SendCall(16, 22, 0, L, True))
    r.plan(1 << 20)
    got += planned(r)
    want = expected_writes(SRC, DST, FULL, SRC_PAGES, np.arange(20, 26)) + expected_writes(
        SRC, DST, SWA, [51, 52, 53], [40, 41, 42]
    )
    assert sorted(got) == sorted(want) and len(set(got)) == len(got)


def lead_room(src_swa=SRC_SWA) -> tuple[SenderRoom, Destination]:
    """The decode holds 16 tokens (pages 0..3, its cache's) but, of its last window [3, 6), not
    the window page of logical page 3: it asks for it before its prefix (43), then 4, 5 (44, 45)."""
    r, d = room(src_swa=src_swa, prefix=16, dst_swa=[44, 45])
    d.dst_swa_lead, d.swa_lead_sent = np.array([43]), np.zeros(L, dtype=bool)
    return r, d


def test_room_sends_the_window_pages_below_the_decode_prefix_once():
    r, _ = lead_room()
    r.add_call(SendCall(0, 22, 0, L, True))
    r.plan(1 << 20)
    got = planned(r)
    want = expected_writes(SRC, DST, FULL, SRC_PAGES[4:], [24, 25]) + expected_writes(
        SRC, DST, SWA, [30, 31, 32], [43, 44, 45]
    )
    assert sorted(got) == sorted(want) and len(set(got)) == len(got)


def test_window_pages_below_the_prefix_go_with_each_layer_group_s_first_call_past_it():
    """Chunks of 12 and 10 tokens, two layer groups: the first chunk ends before the decode's
    prefix (nothing moves, the lead pages' KV may not be computed yet); the second chunk's first
    group sends layer 1's lead page, the second group layer 3's; the last call flushes the rest."""
    r, d = lead_room()
    r.add_call(SendCall(0, 12, 0, 2, False))
    r.add_call(SendCall(0, 12, 2, 4, False))
    r.plan(1 << 20)
    assert planned(r) == [] and not d.swa_lead_sent.any()
    r.add_call(SendCall(12, 22, 0, 2, False))  # page 4 full, page 5 partial
    r.plan(1 << 20)
    assert sorted(planned(r)) == sorted(
        expected_writes(SRC, DST, (0,), [14], [24]) + expected_writes(SRC, DST, (1,), [30, 31], [43, 44])
    )
    assert d.swa_lead_sent.tolist() == [False, True, False, False]
    r.add_call(SendCall(12, 22, 2, 4, False))
    r.plan(1 << 20)
    assert sorted(planned(r)) == sorted(
        expected_writes(SRC, DST, (2,), [14], [24]) + expected_writes(SRC, DST, (3,), [30, 31], [43, 44])
    )
    r.add_call(SendCall(22, 22, 0, L, True))
    r.plan(1 << 20)
    assert sorted(planned(r)) == sorted(
        expected_writes(SRC, DST, FULL, [15], [25]) + expected_writes(SRC, DST, SWA, [32], [45])
    )


def test_room_refuses_a_window_page_below_the_prefix_the_prefill_does_not_hold():
    r, _ = lead_room(src_swa=[-1, -1, -1, -1, 31, 32])
    r.add_call(SendCall(0, 22, 0, L, True))
    with pytest.raises(PlanError, match="logical page 3"):
        r.plan(1 << 20)


def test_partial_page_of_a_window_waits_for_the_next_chunk():
    r, d = room()
    r.add_call(SendCall(0, 14, 0, L, False))  # pages 0..2 full, page 3 (tokens 12..15) partial
    r.plan(1 << 20)
    assert sorted(planned(r)) == sorted(expected_writes(SRC, DST, FULL, SRC_PAGES[:3], np.arange(20, 23)))
    assert d.cursor.tolist() == [12] * L
    r.add_call(SendCall(14, 22, 0, L, True))
    r.plan(1 << 20)
    assert sorted(planned(r)) == sorted(
        expected_writes(SRC, DST, FULL, SRC_PAGES[3:], np.arange(23, 26))
        + expected_writes(SRC, DST, SWA, [30, 31, 32], [40, 41, 42])
    )


def test_swa_rooms_are_never_staged():
    dst = layout(1 << 40, heads=1, start=1)
    r, d = room(heads=(1, 2), dst_layout=dst)
    d.staging = StagingInfo("tcp://agent", 1 << 50, 64 << 20)
    r.add_call(SendCall(0, 22, 0, L, True))
    r.plan(1 << 20, StagingPolicy("on", 1 << 20, 4 << 20), iter(range(100)))
    assert not r.staged and r.queued  # plain head-slice ops
    pn, hn = SRC.page_nbytes, SRC.head_nbytes
    want = [(s + hn, dd) for s, dd in expected_writes(SRC, dst, SWA, [30, 31, 32], [40, 41, 42])]
    got = []
    for b in r.queued:
        got += list(zip(b.src.tolist(), b.dst.tolist()))
        assert set(b.length.tolist()) == {hn}
    assert set(want) <= set(got) and len(got) == (len(FULL) * 6 + len(SWA) * 3) * 2
    assert pn == 2 * hn


# ---- requests and protocol -----------------------------------------------------------------


class Book:
    def __init__(self, peer_layout: KVLayout = DST, own: KVLayout = SRC):
        self.sent = []
        self.book = SenderBook(CFG, own, 0, 1, "p/0", lambda a, msg: self.sent.append(msg) or True)
        register_answered(self.book, m.RegisterPeer("d/0", 0, 1, "data-d", "tcp://d", peer_layout), 0.0)

    def reasons(self) -> dict[int, str]:
        return {s.room: s.reason for s in self.sent if isinstance(s, m.TransferStatus)}


def test_requests_are_checked_against_the_window_rules():
    b = Book()

    def req(room, swa, pages=(1, 2, 3)):
        return m.TransferRequest(room, "d/0", pages, 0, 0, dst_swa_pages=swa)

    b.book.on_message(m.TransferRequest(1, "d/0", (1, 2), 0, 0), 0.0)
    b.book.on_message(req(2, (-1, 7, PAGES)), 0.0)
    b.book.on_message(req(3, (-1, 7, 7)), 0.0)
    b.book.on_message(req(4, (-1, 3, 8)), 0.0)  # 3 is a full page of the request: aliased buffers
    b.book.on_message(req(5, (-1, -1, 8)), 0.0)  # valid
    reasons = b.reasons()
    assert "needs dst_swa_pages" in reasons[1]
    assert f"in [0, {PAGES})" in reasons[2]
    assert "duplicate sliding-window pages" in reasons[3]
    assert "also a full-attention page" in reasons[4]
    assert 5 not in reasons and b.book.rooms[5].dests["d/0"].dst_swa_pages.tolist() == [-1, -1, 8]
    # without aliasing a shared id is fine (separate tensors)
    b2 = Book(layout(1 << 40, alias=False), layout(1 << 30, alias=False))
    b2.book.on_message(req(4, (-1, 3, 8)), 0.0)
    assert 4 not in b2.reasons()
    # a model without sliding layers refuses window pages
    b3 = Book(layout(1 << 40, swa=()), layout(1 << 30, swa=()))
    b3.book.on_message(req(6, (-1, -1, 8)), 0.0)
    assert "for a model without sliding-window layers" in b3.reasons()[6]
    with pytest.raises(ValueError, match="3 sliding-window pages for 2 pages after a 0-token prefix"):
        req(7, (-1, 2, 3), pages=(1, 2))
    with pytest.raises(ValueError, match="-1"):
        req(8, (-2, 2, 3))


def test_requests_may_name_window_pages_below_their_prefix_up_to_its_length():
    b = Book()

    def req(room, swa, prefix=8, pages=(1, 2)):
        return m.TransferRequest(room, "d/0", pages, prefix, 0, dst_swa_pages=swa)

    b.book.on_message(req(1, (9, -1, 7, 8)), 0.0)  # logical pages 0, 1 (below the 2-page prefix), 2, 3
    b.book.on_message(req(2, (10, 9, -1, 7, 8)), 0.0)  # 3 before a 2-page prefix
    b.book.on_message(req(3, (1, 7, 8)), 0.0)  # a full page of the request: aliased buffers
    reasons = b.reasons()
    assert 1 not in reasons
    dest = b.book.rooms[1].dests["d/0"]
    assert dest.dst_swa_pages.tolist() == [7, 8] and dest.dst_swa_lead.tolist() == [9, -1]
    assert "5 sliding-window pages for 2 pages (same length, or up to 2 more before them)" in reasons[2]
    assert "also a full-attention page" in reasons[3]
    b.book.on_message(req(4, (7, 8), prefix=0), 0.0)
    assert b.book.rooms[4].dests["d/0"].dst_swa_lead is None
    with pytest.raises(ValueError, match="after a 1-token prefix"):
        req(5, (6, 5, 7, 8), prefix=1)


def test_book_sends_window_pages_below_the_prefix_from_a_request():
    b = Book()
    b.book.add_room(1, SRC_PAGES, 0.0, swa_pages=SRC_SWA)
    b.book.on_message(m.TransferRequest(1, "d/0", (24, 25), 16, 0, dst_swa_pages=(43, 44, 45)), 0.0)
    assert b.book.add_call(1, SendCall(0, 22, 0, L, True), (1, 0.0), SRC_PAGES, SRC_SWA)
    take, _, _ = b.book.take_work(1.0)
    got = []
    for _, batch in take:
        got += writes_of(batch.src, batch.dst, batch.length)
    assert sorted(got) == sorted(
        expected_writes(SRC, DST, FULL, SRC_PAGES[4:], [24, 25])
        + expected_writes(SRC, DST, SWA, [30, 31, 32], [43, 44, 45])
    )


def test_book_takes_newer_window_tables_with_send_calls():
    b = Book()
    b.book.add_room(1, SRC_PAGES[:4], 0.0, swa_pages=np.array([-1, -1, 50, 51]))
    b.book.on_message(
        m.TransferRequest(1, "d/0", tuple(range(20, 26)), 0, 0, dst_swa_pages=(-1, -1, -1, 40, 41, 42)), 0.0
    )
    with pytest.raises(ValueError, match="7 sliding-window pages for 6 pages"):
        b.book.add_call(1, SendCall(0, 22, 0, L, True), (1, 0.0), SRC_PAGES, np.arange(30, 37))
    with pytest.raises(ValueError, match="also a full-attention page"):
        b.book.add_call(1, SendCall(0, 22, 0, L, True), (1, 0.0), SRC_PAGES, np.array([-1, -1, -1, 15, 31, 32]))
    r = b.book.rooms[1]
    assert r.src_pages.size == 4 and r.src_swa_pages.tolist() == [-1, -1, 50, 51]  # refused calls change nothing
    assert b.book.add_call(1, SendCall(0, 22, 0, L, True), (1, 0.0), SRC_PAGES, SRC_SWA)
    assert r.src_swa_pages.tolist() == SRC_SWA.tolist() and r.src_pages.size == 6
    take, _, _ = b.book.take_work(1.0)
    got = []
    for _, batch in take:
        got += writes_of(batch.src, batch.dst, batch.length)
    assert sorted(got) == sorted(
        expected_writes(SRC, DST, FULL, SRC_PAGES, np.arange(20, 26))
        + expected_writes(SRC, DST, SWA, [30, 31, 32], [40, 41, 42])
    )
    assert b.book.rooms[1].rec.state is TransferState.TRANSFERRING


def test_protocol_round_trip_with_window_pages():
    for msg in (
        m.TransferRequest(5, "d/0", (4, 5, 6), 0, 1, dst_swa_pages=(-1, 9, 10)),
        m.TransferRequest(5, "d/0", (), 0, 1, dst_swa_pages=()),
        m.TransferRequest(5, "d/0", (4, 5), 8, 1, dst_swa_pages=(3, -1, 9, 10)),  # 2 below the prefix
        m.RegisterPeer("d/0", 0, 1, "x", "tcp://x", DST),
    ):
        assert m.decode(m.encode(msg)) == msg
    assert m.decode(m.encode(m.RegisterPeer("d/0", 0, 1, "x", "tcp://x", DST))).layout.swa_layers == SWA
    wire = msgpack.unpackb(m.encode(m.TransferRequest(5, "d/0", (4, 5), 0, 1, dst_swa_pages=(-1, 9))))
    wire["dst_swa_pages"] = np.asarray([-2, 9], dtype="<i8").tobytes()
    with pytest.raises(ProtocolError, match="below -1"):
        m.decode(msgpack.packb(wire))
    wire["dst_swa_pages"] = np.asarray([-1], dtype="<i8").tobytes()
    with pytest.raises(ProtocolError, match="1 sliding-window pages for 2 pages"):
        m.decode(msgpack.packb(wire))
    wire["dst_swa_pages"], wire["dst_pages"] = None, np.asarray([-1, 3], dtype="<i8").tobytes()
    with pytest.raises(ProtocolError, match="below 0"):  # dst_pages stay non-negative
        m.decode(msgpack.packb(wire))


def test_bootstrap_info_keeps_swa_layers_through_json():
    info = PrefillRankInfo(0, 1, SRC, "127.0.0.1:1", "tcp://127.0.0.1:2", "m", "i")
    back = PrefillRankInfo.from_dict(json.loads(json.dumps(info.to_dict())))
    assert back == info and back.layout.swa_layers == SWA


def test_pool_bytes_count_aliased_tensors_once():
    pool = KVPool(L, 8, PS, 2, HD)
    whole = pool.nbytes
    pool.k[1], pool.v[1] = pool.k[0], pool.v[0]
    assert pool.nbytes == whole * 3 // 4
