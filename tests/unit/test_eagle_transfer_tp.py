"""An EAGLE head's KV under tensor parallelism, the same or different on the two sides
(disagg/mtp_transfer.py, engine/spec/eagle_drafter.py): unlike NEXTN's MLA latent, the head's pool is
a GQA layer's K and V, which a TP target would slice by head; the head runs whole on TP rank 0
of each side, so at prefill TP x decode TP = (1,2), (2,1), (2,2) prefill rank 0 writes whole pages
of all the head's KV heads into decode rank 0 and nothing else moves them, while the target's
K/V reaches each decode rank as its own head slice, once; a decode rank 0 that announces a
head-sliced head pool is refused; the handshake names where the head's KV lives and is the same
at every TP. tests/integration/test_pd_eagle_tp.py runs the same moves between engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.config import ParallelConfig, ServerConfig, SpeculativeConfig
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.disagg.mtp_transfer import MTP_RANK
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import source_ranks
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import SendCall
from tests.helpers.draft_models import write_eagle_head
from tests.unit.test_mtp_transfer import CFG, PAGES, PS
from tests.unit.test_mtp_transfer_tp import DST_PAGES, HIDDEN, MTP_BASE, SRC_PAGES, register

L, DIM = 2, 8  # target layers, head dim
TARGET_HEADS, HEAD_HEADS = 4, 2  # the target's KV heads (sliced by TP), the EAGLE head's (whole on rank 0)


def gqa(base: int, layers: int, heads: int, total: int, start: int = 0) -> KVLayout:
    """A K/V pool holding heads [start, start + heads) of `total`: 2 buffers a layer."""
    addrs = tuple(base + i * (1 << 20) for i in range(2 * layers))
    return KVLayout(layers, PS, heads, start, total, DIM, "float32", 4, addrs, PAGES * PS * heads * DIM * 4)


def target(base: int, rank: int, tp: int) -> KVLayout:
    """TP rank `rank`'s slice of the target's KV heads."""
    heads = TARGET_HEADS // tp
    return gqa(base, L, heads, TARGET_HEADS, ParallelConfig(tp, rank).kv_head_start(TARGET_HEADS))


def head_pool(base: int) -> KVLayout:
    """The EAGLE head's one-layer K/V, all its KV heads (rank 0's)."""
    return gqa(MTP_BASE + base, 1, HEAD_HEADS, HEAD_HEADS)


def prefill_book(rank: int, tp: int) -> SenderBook:
    base = (1 + rank) << 30
    return SenderBook(
        CFG,
        target(base, rank, tp),
        rank,
        tp,
        f"p/{rank}",
        lambda a, msg: True,
        draft_layout=head_pool(base) if rank == MTP_RANK else None,
        draft_at_prefix=True,
        draft_rank=MTP_RANK,
    )


def decode_ranks(tp: int) -> list[tuple[KVLayout, KVLayout | None]]:
    """Each decode rank's (target slice, head pool): the head pool on rank 0 only."""
    return [(target((8 + r) << 36, r, tp), head_pool((8 + r) << 36) if r == MTP_RANK else None) for r in range(tp)]


def ops_of(b: SenderBook) -> list[tuple[int, int, int]]:
    """(src address, dst address, bytes) of every write planned."""
    take, _, _ = b.take_work(0.0)
    return [op for _, batch in take for op in zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist())]


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_prefill_rank0_writes_whole_head_pages_into_decode_rank0_only(p_tp: int, d_tp: int):
    """Every prefill rank plans its part of a 10-token room (3 pages): the head's K and V leave
    prefill rank 0 as whole pages (all its KV heads, never a head slice) into decode rank 0's
    pool; each decode rank gets its own slice of the target's heads once; rank 0's aux alone
    carries the draft fields."""
    decode = decode_ranks(d_tp)
    head_ops: list[tuple[int, list[tuple[int, int, int]]]] = []
    target_bytes = dict.fromkeys(range(d_tp), 0)
    for p in range(p_tp):
        b = prefill_book(p, p_tp)
        b.add_room(1, SRC_PAGES, 0.0, draft_pages=SRC_PAGES if p == MTP_RANK else None)
        paired = [r for r in range(d_tp) if p in source_ranks(r, p_tp, d_tp)]
        for r in paired:
            assert register(b, r, d_tp, *decode[r]) is None
            draft = DST_PAGES if decode[r][1] is not None else None  # as the decode's receiver asks
            b.on_message(m.TransferRequest(1, f"d/{r}", DST_PAGES, 0, 0, dst_draft_pages=draft), 0.0)
        b.add_call(1, SendCall(0, 10, 0, L + (p == MTP_RANK), True), (7, -0.5, 0, HIDDEN))
        ops = ops_of(b)
        head_ops.append((p, sorted(o for o in ops if o[0] >= MTP_BASE)))
        for s, d, n in ops:
            if s < MTP_BASE:
                target_bytes[(d >> 36) - 8] += n
        aux = b.rooms[1].aux
        want = (10, HIDDEN) if p == MTP_RANK else (0, b"")
        assert aux is not None and (aux.first_token_id, aux.draft_tokens, aux.hidden) == (7, *want)
    src, dst = head_pool((1 + MTP_RANK) << 30), decode[MTP_RANK][1]
    assert dst is not None
    whole: set[tuple[int, int]] = set()  # the head ops split into whole head pages
    for _, ops in head_ops:
        for s, d, n in ops:
            assert n % src.page_nbytes == 0, f"a write of {n} bytes: not whole pages of {src.page_nbytes}"
            whole |= {(s + i * src.page_nbytes, d + i * src.page_nbytes) for i in range(n // src.page_nbytes)}
    assert whole == {
        (src.buffer_addrs[i] + int(sp) * src.page_nbytes, dst.buffer_addrs[i] + dp * dst.page_nbytes)
        for i in range(src.num_buffers)
        for sp, dp in zip(SRC_PAGES, DST_PAGES)
    }
    assert [p for p, ops in head_ops if ops] == [MTP_RANK]
    slice_page = (TARGET_HEADS // d_tp) * PS * DIM * 4  # one page of a decode rank's target heads
    assert target_bytes == dict.fromkeys(range(d_tp), len(SRC_PAGES) * 2 * L * slice_page)


def test_a_head_sliced_head_pool_is_refused():
    """Decode rank 0 must hold all the head's KV heads (a TP decode that sliced the head's pool
    like the target's could not take whole pages)."""
    dst, _ = decode_ranks(2)[0]
    sliced = gqa(MTP_BASE + (8 << 36), 1, HEAD_HEADS // 2, HEAD_HEADS)
    why = register(prefill_book(0, 1), 0, 2, dst, sliced)
    assert why is not None and "holds heads [0, 1) of 2, not all" in why, why


def test_the_handshake_names_where_the_head_kv_lives_the_same_at_every_tp(tiny_model_dir: Path, tmp_path: Path):
    spec = SpeculativeConfig("EAGLE", draft_model_path=str(write_eagle_head(tiny_model_dir, tmp_path / "h")))
    lay = head_pool(0)
    shakes = {
        speculative_handshake(ServerConfig(model_path=str(tiny_model_dir), tp_size=tp, speculative=spec), lay)
        for tp in (1, 2, 4)
    }
    assert len(shakes) == 1 and next(iter(shakes)).endswith(":at=rank0"), shakes
