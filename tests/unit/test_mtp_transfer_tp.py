"""NEXTN's MTP KV under tensor parallelism, the same or different on the two sides
(disagg/mtp_transfer.py): the MTP layer's latent KV lives whole on TP rank 0 of each side, so at
prefill TP x decode TP = (1,2), (2,1), (2,2) prefill rank 0 writes the whole MTP pool into decode
rank 0 and nothing else moves it, while the target's latent reaches every decode rank once; only
rank 0's aux carries the draft fields (draft tokens, hidden row) and the decode merges them into
the other ranks' aux; a decode that announces an MTP pool on another rank is refused; the decode
asks only its ranks that hold a draft pool for draft pages; the handshake names where the MTP KV
lives and is the same at every TP."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.config import ServerConfig, SpeculativeConfig
from kvpipe.disagg.draft_transfer import speculative_handshake
from kvpipe.disagg.mtp_transfer import MTP_RANK
from kvpipe.model.presets import write_preset
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import PrefillInstanceInfo, PrefillRankInfo
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import source_ranks
from kvpipe.transfer.receiver.book import ReceiverBook
from kvpipe.transfer.receiver.room import merge_aux
from kvpipe.transfer.sender.book import SenderBook
from kvpipe.transfer.sender.plan_types import SendCall
from tests.helpers.registered import accept_registrations, register_answered
from tests.unit.test_mtp_transfer import CFG, PAGES, PS

L, DIM = 2, 8  # target layers, latent dim
SRC_PAGES = np.arange(10, 13)  # a 10-token prompt: 3 pages (the MTP's are the target's page ids)
DST_PAGES = (30, 31, 32)
MTP_BASE = 1 << 44  # every MTP buffer lies above it, every target buffer below
HIDDEN = b"\x01" * 16  # h_{L-1} as AuxData.hidden carries it


def latent(base: int, layers: int) -> KVLayout:
    """An MLA latent pool (one buffer per layer, one "head"): the same on every TP rank."""
    addrs = tuple(base + i * (1 << 20) for i in range(layers))
    return KVLayout(layers, PS, 1, 0, 1, DIM, "float32", 4, addrs, PAGES * PS * DIM * 4, buffers_per_layer=1)


def prefill_book(rank: int, tp: int) -> SenderBook:
    """Prefill rank `rank` of TP `tp` with NEXTN: rank 0 alone holds the MTP pool."""
    base = (1 + rank) << 30
    mtp = latent(MTP_BASE + base, 1) if rank == MTP_RANK else None
    return SenderBook(
        CFG,
        latent(base, L),
        rank,
        tp,
        f"p/{rank}",
        lambda a, msg: True,
        draft_layout=mtp,
        draft_at_prefix=True,
        draft_rank=MTP_RANK,
    )


def decode_ranks(tp: int) -> list[tuple[KVLayout, KVLayout | None]]:
    """Each decode rank's (target pool, MTP pool): the MTP pool on rank 0 only."""
    return [
        (latent((8 + r) << 36, L), latent(MTP_BASE + ((8 + r) << 36), 1) if r == MTP_RANK else None) for r in range(tp)
    ]


def register(b: SenderBook, rank: int, tp: int, dst: KVLayout, mtp: KVLayout | None) -> str | None:
    register_answered(b, m.RegisterPeer(f"d/{rank}", rank, tp, f"data-d{rank}", "tcp://d", dst, draft=mtp), 0.0)
    rej = b.peers.rejected.get(f"d/{rank}")
    return None if rej is None else rej[0]


def ops_of(b: SenderBook) -> set[tuple[int, int]]:
    """(src address, dst address) of every page planned (runs split into pages; the target's and
    the MTP's pages have one size)."""
    out: set[tuple[int, int]] = set()
    pn = PS * DIM * 4
    take, _, _ = b.take_work(0.0)
    for _, batch in take:
        for s, d, n in zip(batch.src.tolist(), batch.dst.tolist(), batch.length.tolist()):
            out |= {(s + i * pn, d + i * pn) for i in range(n // pn)}
    return out


def pages(src: KVLayout, dst: KVLayout, layers: int) -> set[tuple[int, int]]:
    """The room's pages of `layers` layers, SRC_PAGES into DST_PAGES."""
    return {
        (src.buffer_addrs[i] + int(sp) * src.page_nbytes, dst.buffer_addrs[i] + dp * dst.page_nbytes)
        for i in range(layers)
        for sp, dp in zip(SRC_PAGES, DST_PAGES)
    }


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_prefill_rank0_writes_the_mtp_kv_into_decode_rank0_only(p_tp: int, d_tp: int):
    """Every prefill rank plans its part of a 10-token room: the target's latent reaches each
    decode rank from one prefill rank, the MTP layer from prefill rank 0 into decode rank 0 only;
    rank 0's aux holds the draft fields, the others' none."""
    decode = decode_ranks(d_tp)
    target: dict[int, set[tuple[int, int]]] = {r: set() for r in range(d_tp)}
    mtp: list[tuple[int, set[tuple[int, int]]]] = []
    for p in range(p_tp):
        b = prefill_book(p, p_tp)
        b.add_room(1, SRC_PAGES, 0.0, draft_pages=SRC_PAGES if p == MTP_RANK else None)
        paired = [r for r in range(d_tp) if p in source_ranks(r, p_tp, d_tp)]
        for r in paired:
            assert register(b, r, d_tp, *decode[r]) is None
            draft = DST_PAGES if decode[r][1] is not None else None  # as the decode's receiver asks
            b.on_message(m.TransferRequest(1, f"d/{r}", DST_PAGES, 0, 0, dst_draft_pages=draft), 0.0)
        layers = L + (p == MTP_RANK)  # the MTP layer is send layer L on rank 0 only
        b.add_call(1, SendCall(0, 10, 0, layers, True), (7, -0.5, 0, HIDDEN))
        ops = ops_of(b)
        mtp.append((p, {o for o in ops if o[0] >= MTP_BASE}))
        for r in paired:
            target[r] |= {o for o in ops if o[1] >> 36 == 8 + r and o[0] < MTP_BASE}
        aux = b.rooms[1].aux
        want = (10, HIDDEN) if p == MTP_RANK else (0, b"")
        assert aux is not None and (aux.first_token_id, aux.draft_tokens, aux.hidden) == (7, *want)
    for r in range(d_tp):  # the target's latent once per decode rank, from its first source rank
        p = source_ranks(r, p_tp, d_tp)[0]
        assert target[r] == pages(latent((1 + p) << 30, L), decode[r][0], L), (r, p)
    dst_mtp = decode[MTP_RANK][1]
    assert dst_mtp is not None
    want_mtp = pages(latent(MTP_BASE + (1 << 30), 1), dst_mtp, 1)
    assert mtp == [(p, want_mtp if p == MTP_RANK else set()) for p in range(p_tp)]


def test_an_mtp_pool_on_another_decode_rank_is_refused_and_ranks_without_one_accept_rank0s():
    dst, mtp = decode_ranks(2)[0]
    assert mtp is not None
    b0 = prefill_book(0, 1)  # TP 1 -> TP 2: decode rank 1 claims an MTP pool too
    why = register(b0, 1, 2, latent(9 << 36, L), latent(MTP_BASE + (9 << 36), 1))
    assert why is not None and "lives on TP rank 0 only" in why, why
    b1 = prefill_book(1, 2)  # TP 2 -> TP 1: prefill rank 1 has no MTP pool, decode rank 0 has
    assert register(b1, 0, 1, dst, mtp) is None
    assert b1.peers.draft_heads.get("d/0") is None  # it never writes MTP KV
    b0 = prefill_book(0, 2)
    assert register(b0, 0, 1, dst, mtp) is None and b0.peers.draft_heads["d/0"] == (0, 1)
    bare = SenderBook(CFG, latent(1 << 30, L), 0, 1, "p/0", lambda a, msg: True, draft_rank=MTP_RANK)
    why = register(bare, 0, 1, dst, mtp)  # rank 0 should hold the MTP pool: nobody would fill decode rank 0's
    assert why is not None and "has no draft-model KV pool" in why, why


def test_the_decode_asks_its_mtp_rank_only_for_draft_pages():
    sent: list[object] = []
    ranks = [m.DecodeRank(t, f"data-d{r}", draft=mtp) for r, (t, mtp) in enumerate(decode_ranks(2))]
    book = ReceiverBook(CFG, ranks, "d", "tcp://decode", lambda a, msg: sent.append(msg) or True)
    lay = latent(1 << 30, L)
    info = PrefillInstanceInfo("p0", 1, "m", (PrefillRankInfo(0, 1, lay, "data-p0", "tcp://p0", "m", "p0"),))
    addr = ("prefill-host", 8998)
    pages = book.check_pages(1, [np.array(DST_PAGES)] * 2, 0)
    draft = book.check_draft_pages(1, np.array(DST_PAGES))
    assert book.add_room(1, addr, pages, 0, 0, 0.0, draft_pages=draft) == addr
    book.on_fetched(addr, info, None, 0.0)
    accept_registrations(book, addr)
    reqs = {msg.session_id.split("/")[1]: msg for msg in sent if isinstance(msg, m.TransferRequest)}
    assert reqs["0"].dst_draft_pages == DST_PAGES and reqs["1"].dst_draft_pages is None
    swapped = [m.DecodeRank(ranks[0].layout, "data-d0"), m.DecodeRank(ranks[1].layout, "data-d1", draft=ranks[0].draft)]
    with pytest.raises(ValueError, match="decode rank 0"):
        ReceiverBook(CFG, swapped, "d", "tcp://decode", lambda a, msg: True).check_draft_pages(1, [1])


def test_the_decode_merges_rank0s_draft_fields_into_the_other_ranks_aux():
    full = m.AuxData(1, 7, -0.5, 0, draft_tokens=10, hidden=HIDDEN)
    bare = m.AuxData(1, 7, -0.5, 0)
    assert merge_aux(None, bare) == (bare, None)
    assert merge_aux(bare, full) == (full, None) and merge_aux(full, bare) == (full, None)
    assert merge_aux(full, full) == (full, None)
    other_hidden = m.AuxData(1, 7, -0.5, 0, draft_tokens=10, hidden=b"\x02" * 16)
    assert merge_aux(full, other_hidden) == (full, "the draft state (draft tokens, hidden state)")
    assert merge_aux(full, m.AuxData(1, 8, -0.5, 0)) == (full, "the first token")


def test_a_room_of_a_tp2_prefill_succeeds_with_rank0s_draft_fields_whatever_the_order():
    lay = latent(1 << 30, L)
    info = PrefillInstanceInfo(
        "p0", 2, "m", tuple(PrefillRankInfo(p, 2, lay, f"data-p{p}", f"tcp://p{p}", "m", "p0") for p in range(2))
    )
    for order in ((0, 1), (1, 0)):
        t, mtp = decode_ranks(1)[0]
        book = ReceiverBook(CFG, [m.DecodeRank(t, "data-d0", draft=mtp)], "d", "tcp://decode", lambda a, msg: True)
        addr = ("prefill-host", 8998)
        pages = book.check_pages(1, [np.array(DST_PAGES)], 0)
        book.add_room(1, addr, pages, 0, 0, 0.0, draft_pages=book.check_draft_pages(1, np.array(DST_PAGES)))
        book.on_fetched(addr, info, None, 0.0)
        accept_registrations(book, addr)
        session = book.rooms[1].sessions[0]
        for p in order:
            aux = m.AuxData(1, 7, -0.5, 0, **({"draft_tokens": 10, "hidden": HIDDEN} if p == MTP_RANK else {}))
            book.on_message(m.TransferStatus(1, session, m.WireState.SUCCESS, aux=aux, sender=f"p0/{p}"), 1.0)
        [(room, state, reason, aux)] = book.poll(1.0)
        assert (room, state, reason) == (1, TransferState.SUCCESS, "")
        assert aux == m.AuxData(1, 7, -0.5, 0, draft_tokens=10, hidden=HIDDEN), order


def test_the_handshake_names_where_the_mtp_kv_lives_the_same_at_every_tp(tmp_path):
    path = write_preset("tiny-deepseek-v3", tmp_path / "ds")
    spec = SpeculativeConfig("NEXTN")
    shakes = {
        speculative_handshake(ServerConfig(model_path=str(path), tp_size=tp, speculative=spec), latent(MTP_BASE, 1))
        for tp in (1, 2, 4)
    }
    assert len(shakes) == 1 and next(iter(shakes)).endswith(":at=rank0"), shakes
