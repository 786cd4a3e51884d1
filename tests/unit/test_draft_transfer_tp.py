"""A STANDALONE draft model's KV under heterogeneous TP (disagg/draft_transfer.py, sender/room.py):
the draft's heads pair up by the target's rank mapping over the draft's own head count, so each
decode rank gets its shard of the draft's heads once, as head slices of each page after the
target's layers; a replicated draft head is sent by one prefill rank only, also where that rank
owes the decode no target head; a decode rank that holds another draft head range is refused;
the handshake names the draft's KV heads before TP, so servers of different TP agree."""

from __future__ import annotations

import numpy as np

from kvpipe.config import ServerConfig, SpeculativeConfig
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import SendCall
from tests.helpers.registered import register_answered
from tests.unit.test_draft_transfer_plan import CFG, PAGES, PS

L = 2  # target layers; the draft has 1
SRC_PAGES, SRC_DRAFT_PAGES = np.arange(10, 13), np.arange(20, 23)  # a 10-token prompt: 3 pages
DST_PAGES, DST_DRAFT_PAGES = (30, 31, 32), (40, 41, 42)
T_DIM, D_DIM = 8, 4  # head_dim of the target and of the draft
DRAFT_BASE = 1 << 44  # every draft buffer lies above it, every target buffer below


def layout(base: int, layers: int, heads: int, start: int, total: int, head_dim: int) -> KVLayout:
    page = heads * PS * head_dim * 4
    addrs = tuple(base + i * (1 << 20) for i in range(2 * layers))
    return KVLayout(layers, PS, heads, start, total, head_dim, "float32", 4, addrs, PAGES * page)


def target(base: int, heads: int, start: int) -> KVLayout:
    return layout(base, L, heads, start, 2, T_DIM)


def draft(base: int, heads: int, start: int, total: int) -> KVLayout:
    return layout(DRAFT_BASE + base, 1, heads, start, total, D_DIM)


def sliced_ops(src: KVLayout, dst: KVLayout, layers: int, heads: tuple[int, int]) -> set[tuple[int, int, int]]:
    """(src address, dst address, bytes) of global heads `heads` of the room's pages, per layer, K
    and V: one op per page, or one per run of pages where the slice is whole pages on both sides."""
    is_draft = src.buffer_addrs[0] >= DRAFT_BASE
    src_pages, dst_pages = (SRC_DRAFT_PAGES, DST_DRAFT_PAGES) if is_draft else (SRC_PAGES, DST_PAGES)
    hb = PS * src.head_dim * 4
    n = (heads[1] - heads[0]) * hb
    if n == src.page_nbytes == dst.page_nbytes:  # consecutive pages on both sides: one run
        src_pages, dst_pages, n = src_pages[:1], dst_pages[:1], n * len(dst_pages)
    return {
        (
            src.buffer_addrs[2 * i + kv] + int(sp) * src.page_nbytes + (heads[0] - src.head_start) * hb,
            dst.buffer_addrs[2 * i + kv] + int(dp) * dst.page_nbytes + (heads[0] - dst.head_start) * hb,
            n,
        )
        for i in range(layers)
        for kv in (0, 1)
        for sp, dp in zip(src_pages, dst_pages)
    }


def book(rank: int, tp: int, src: KVLayout, src_draft: KVLayout) -> tuple[SenderBook, list[object]]:
    sent: list[object] = []
    b = SenderBook(CFG, src, rank, tp, f"p/{rank}", lambda a, msg: sent.append(msg) or True, draft_layout=src_draft)
    return b, sent


def run_room(b: SenderBook, decode_tp: int) -> tuple[set[tuple[int, int, int]], set[tuple[int, int, int]]]:
    """A 10-token room sent whole to every decode rank: (target ops, draft ops) planned, page by
    page (a run of whole pages split into its pages)."""
    b.add_room(1, SRC_PAGES, 0.0, draft_pages=SRC_DRAFT_PAGES)
    for r in range(decode_tp):
        b.on_message(m.TransferRequest(1, f"d/{r}", DST_PAGES, 0, 0, dst_draft_pages=DST_DRAFT_PAGES), 0.0)
    b.add_call(1, SendCall(0, 10, 0, L + 1, True), (7, -0.5))
    ops: set[tuple[int, int, int]] = set()
    take, _, _ = b.take_work(0.0)
    for _, batch in take:
        ops |= set(zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()))
    return {o for o in ops if o[0] < DRAFT_BASE}, {o for o in ops if o[0] >= DRAFT_BASE}


def register(b: SenderBook, rank: int, tp: int, dst: KVLayout, dst_draft: KVLayout) -> None:
    register_answered(b, m.RegisterPeer(f"d/{rank}", rank, tp, f"data-d{rank}", "tcp://d", dst, draft=dst_draft), 0.0)


def test_prefill_tp1_to_decode_tp2_slices_the_draft_heads():
    """A draft of 4 KV heads: decode rank r holds draft heads [2r, 2r + 2) and target head r."""
    src, src_draft = target(1 << 30, 2, 0), draft(1 << 30, 4, 0, 4)
    b, sent = book(0, 1, src, src_draft)
    dst = [target((2 + r) << 36, 1, r) for r in range(2)]
    dst_draft = [draft((2 + r) << 36, 2, 2 * r, 4) for r in range(2)]
    for r in range(2):
        register(b, r, 2, dst[r], dst_draft[r])
    t_ops, d_ops = run_room(b, 2)
    assert not [s for s in sent if isinstance(s, m.TransferStatus)], sent
    assert t_ops == sliced_ops(src, dst[0], L, (0, 1)) | sliced_ops(src, dst[1], L, (1, 2))
    assert d_ops == sliced_ops(src_draft, dst_draft[0], 1, (0, 2)) | sliced_ops(src_draft, dst_draft[1], 1, (2, 4))
    assert b.rooms[1].aux == m.AuxData(1, 7, -0.5, 0, draft_tokens=10)


def test_prefill_tp2_to_decode_tp1_sends_a_replicated_draft_head_once():
    """A draft of 1 KV head, replicated on both prefill ranks: rank 0 sends it with target head 0,
    rank 1 sends target head 1 and no draft KV."""
    dst, dst_draft = target(2 << 36, 2, 0), draft(2 << 36, 1, 0, 1)
    planned = []
    for rank in range(2):
        src, src_draft = target((1 + rank) << 30, 1, rank), draft((1 + rank) << 30, 1, 0, 1)
        b, _ = book(rank, 2, src, src_draft)
        register(b, 0, 1, dst, dst_draft)
        t_ops, d_ops = run_room(b, 1)
        assert t_ops == sliced_ops(src, dst, L, (rank, rank + 1))
        planned.append(d_ops)
    src_draft0 = draft(1 << 30, 1, 0, 1)
    assert planned == [sliced_ops(src_draft0, dst_draft, 1, (0, 1)), set()]


def test_prefill_tp2_to_decode_tp1_draft_heads_where_no_target_head_is_owed():
    """Prefill TP 4 over the target's 2 KV heads (ranks 1 and 3 hold a replicated head the pairing
    gives to ranks 0 and 2), a draft of 4 KV heads: every prefill rank sends its own draft head."""
    dst, dst_draft = target(2 << 36, 2, 0), draft(2 << 36, 4, 0, 4)
    for rank in range(4):
        src, src_draft = target((1 + rank) << 30, 1, rank // 2), draft((1 + rank) << 30, 1, rank, 4)
        b, _ = book(rank, 4, src, src_draft)
        register(b, 0, 1, dst, dst_draft)
        t_ops, d_ops = run_room(b, 1)
        assert t_ops == (sliced_ops(src, dst, L, (rank // 2, rank // 2 + 1)) if rank % 2 == 0 else set())
        assert d_ops == sliced_ops(src_draft, dst_draft, 1, (rank, rank + 1))


def test_a_decode_rank_with_another_draft_head_range_is_refused():
    src, src_draft = target(1 << 30, 2, 0), draft(1 << 30, 4, 0, 4)
    b, sent = book(0, 1, src, src_draft)
    register(b, 1, 2, target(3 << 36, 1, 1), draft(3 << 36, 2, 0, 4))  # rank 1 must hold draft heads [2, 4)
    b.on_message(m.TransferRequest(1, "d/1", DST_PAGES, 0, 0, dst_draft_pages=DST_DRAFT_PAGES), 0.0)
    reasons = [s.reason for s in sent if isinstance(s, m.TransferStatus)]
    assert reasons and "holds draft KV heads [0, 2), TP 2 rank 1 needs [2, 4)" in reasons[0], reasons


def test_the_handshake_names_the_draft_kv_before_tp(tiny_model_dir):
    """The handshake's speculative field is the same for every TP (the draft's KV heads before TP):
    a TP 1 prefill and a TP 2 decode with the same draft agree; each rank's slice is checked per
    pair at registration (above)."""
    spec = SpeculativeConfig("STANDALONE", draft_model_path=str(tiny_model_dir))
    cfg = ServerConfig(model_path=str(tiny_model_dir), speculative=spec)
    whole = speculative_handshake(cfg, draft(1 << 30, 4, 0, 4))
    shards = [speculative_handshake(cfg, draft(r << 30, 2, 2 * r, 4)) for r in range(2)]
    assert shards == [whole, whole] and whole.endswith("x1x4x4")
    assert speculative_handshake(cfg, draft(1 << 30, 2, 0, 2)) != whole  # another draft head count
