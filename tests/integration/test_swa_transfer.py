"""KVSender <-> KVReceiver for a sliding-window (GPT-OSS style) model in one process: real KV
pools whose sliding layers alias the full layers' tensors (disjoint page ids keep them apart),
real bootstrap server and ZMQ, local and Mooncake (loopback TCP) backends, same and
heterogeneous TP. Full layers land in every requested page, sliding layers only in the window
pages the decode asked for; every other decode page keeps its sentinel; bytes are as predicted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.disagg.setup import register_pool
from kvpipe.transfer.backends.local import LocalFabric
from kvpipe.transfer.control import messages as m
from kvpipe.transfer.control.bootstrap import BootstrapServer
from kvpipe.transfer.control.messages import DecodeRank
from kvpipe.transfer.lifecycle import TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.tp_mapping import kv_head_range
from kvpipe.transfer.receiver.kv_receiver import KVReceiver
from kvpipe.transfer.sender.kv_sender import KVSender
from tests.helpers.kv_transfer import CFG, Results, make_backend

L, PAGES, PS, HD, H = 4, 32, 4, 8, 2  # KV layers, pages per pool, page size, head dim, total KV heads
SWA = (1, 3)  # sliding layer 2i+1 shares full layer 2i's K and V tensors
FULL = (0, 2)
SENTINEL = -7.0
S, F = TransferState.SUCCESS, TransferState.FAILED

# A 22-token prompt (6 logical pages), window W = 8: the decode wants sliding pages for logical
# pages [w0, 6), w0 = (22 - 8 + 1) // 4 = 3. Full and window tables share one page id space.
SRC = np.array([3, 4, 5, 9, 10, 11])
SRC_SWA_CHUNK1 = np.array([-1, -1, 18, 20])  # after 16 tokens: pages 0, 1 slid out and were freed
SRC_SWA = np.array([-1, -1, -1, 20, 21, 22])  # at the end: page 2 slid out too
DST = np.array([12, 13, 7, 8, 25, 26])
DST_SWA = np.array([-1, -1, -1, 14, 15, 30])


def swa_pool(heads: int) -> KVPool:
    pool = KVPool(L, PAGES, PS, heads, HD)
    for i in SWA:  # alias the buffers, as the engine's pool does
        pool.k[i], pool.v[i] = pool.k[i - 1], pool.v[i - 1]
    pool.swa_layers = SWA
    return pool


def truth(seed: int = 0) -> list[torch.Tensor]:
    """Full-head contents of the distinct tensors (K0, V0, K2, V2): [PAGES, H, PS, HD] each."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGES, H, PS, HD, generator=g) for _ in range(2 * len(FULL))]


def tensors(pool: KVPool) -> list[torch.Tensor]:
    return [t for i in FULL for t in (pool.k[i], pool.v[i])]


class Pair:
    def __init__(self, stack, kind: str, p_tp: int, d_tp: int) -> None:
        fabric = LocalFabric()
        server = stack.enter_context(BootstrapServer("127.0.0.1", 0))
        self.data, self.senders = truth(), []
        for rank in range(p_tp):
            h0, h1 = kv_head_range(p_tp, rank, H)
            pool = swa_pool(h1 - h0)
            for t, full in zip(tensors(pool), self.data):
                t.copy_(full[:, h0:h1])
            layout = KVLayout.from_pool(pool, head_start=h0, total_kv_heads=H)
            assert layout.swa_layers == SWA and layout.aliased
            backend = make_backend(kind, fabric, stack)
            register_pool(backend, layout)  # each distinct tensor once
            s = KVSender(
                CFG, layout=layout, backend=backend, tp_rank=rank, tp_size=p_tp, model_name="m", instance_id="p0"
            )
            s.pool = pool
            stack.callback(s.close)
            self.senders.append(s.start(("127.0.0.1", server.port)))
        self.port = server.port
        self.pools, ranks = [], []
        for rank in range(d_tp):
            h0, h1 = kv_head_range(d_tp, rank, H)
            pool = swa_pool(h1 - h0)
            for t in tensors(pool):
                t.fill_(SENTINEL)
            layout = KVLayout.from_pool(pool, head_start=h0, total_kv_heads=H)
            backend = make_backend(kind, fabric, stack)
            register_pool(backend, layout)
            self.pools.append(pool)
            ranks.append(DecodeRank(layout, backend.address))
        self.recv = KVReceiver(CFG, ranks=ranks, model_name="m").start()
        stack.callback(self.recv.close)

    def add_decode_room(self, room: int, prefix_len: int, dst_swa: np.ndarray = DST_SWA) -> None:
        first = prefix_len // PS
        d_tp = len(self.pools)
        self.recv.add_room(
            room, "127.0.0.1", self.port, [DST[first:]] * d_tp, prefix_len, swa_pages=[dst_swa[first:]] * d_tp
        )

    def send_chunked(self, room: int) -> None:
        """Chunk 1 (16 tokens) in two layer groups, then the last chunk with newer page tables."""
        for s in self.senders:
            s.add_room(room, SRC[:4], src_swa_pages=SRC_SWA_CHUNK1[:2])
            assert s.send(room, 0, 16, 0, 2, src_swa_pages=SRC_SWA_CHUNK1)  # full 0, sliding 1
            assert s.send(room, 0, 16, 2, 4)
            assert s.send(room, 16, 22, last=True, aux=(42, -0.5), src_pages=SRC, src_swa_pages=SRC_SWA)


@pytest.mark.parametrize("kind", ["local", "mooncake"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1)])
def test_sliding_layers_move_only_the_requested_window_pages(stack, kind, p_tp, d_tp):
    pair = Pair(stack, kind, p_tp, d_tp)
    prefix = 8 if p_tp == 2 else 0  # the decode holds the first two pages already (full layers)
    pair.add_decode_room(7, prefix)
    pair.send_chunked(7)
    for s in pair.senders:
        assert Results(s).get(7) == (7, S, "")
    _, state, reason, aux = Results(pair.recv).get(7)
    assert (state, reason, aux) == (S, "", m.AuxData(7, 42, -0.5))

    first = prefix // PS
    want = DST_SWA >= 0
    full_src, full_dst = SRC[first:], DST[first:]
    swa_src, swa_dst = SRC_SWA[want], DST_SWA[want]
    written = np.concatenate([full_dst, swa_dst])
    untouched = np.setdiff1d(np.arange(PAGES), written)
    for rank, pool in enumerate(pair.pools):
        h0, h1 = kv_head_range(d_tp, rank, H)
        # tensors(pool): K, V of full layer 0 (= sliding layer 1), then of layer 2 (= layer 3)
        for t, full in zip(tensors(pool), pair.data, strict=True):
            assert torch.equal(t[full_dst], full[full_src][:, h0:h1])  # full layers: every page
            assert torch.equal(t[swa_dst], full[swa_src][:, h0:h1])  # sliding layers: the window only
            assert (t[untouched] == SENTINEL).all()
    # bytes: every decode head once; full layers x pages + sliding layers x requested pages, K and V
    head_nbytes = PS * HD * 4
    predicted = H * head_nbytes * 2 * (len(FULL) * full_dst.size + len(SWA) * int(want.sum()))
    assert sum(s.stats.bytes_written for s in pair.senders) == predicted
    assert all(s.num_rooms() == 0 for s in pair.senders) and pair.recv.num_active_rooms() == 0


@pytest.mark.parametrize("kind", ["local", "mooncake"])
def test_a_window_page_the_prefill_freed_fails_both_sides(stack, kind):
    """The decode asks for logical page 2's sliding page (its window is wider than the prefill's,
    say): the prefill freed it, so the room fails with the reason on both sides."""
    pair = Pair(stack, kind, 1, 1)
    pair.add_decode_room(3, 0, np.array([-1, -1, 6, 14, 15, 30]))
    pair.send_chunked(3)
    room, state, reason = Results(pair.senders[0]).get(3)
    assert state is F and "prefill holds no sliding-window page for logical page 2" in reason
    _, state, reason, _ = Results(pair.recv).get(3)
    assert state is F and "logical page 2" in reason


def test_decode_add_room_checks_window_pages(stack):
    pair = Pair(stack, "local", 1, 1)
    with pytest.raises(ValueError, match="needs its window pages"):
        pair.recv.add_room(1, "127.0.0.1", pair.port, DST, 0)
    with pytest.raises(ValueError, match="5 sliding-window pages for 6 pages"):
        pair.recv.add_room(1, "127.0.0.1", pair.port, DST, 0, swa_pages=DST_SWA[:5])
    with pytest.raises(ValueError, match="also a full-attention page"):
        pair.recv.add_room(1, "127.0.0.1", pair.port, DST, 0, swa_pages=np.array([-1, -1, -1, 14, 15, 26]))
    with pytest.raises(ValueError, match="outside|in \\[0, 32\\)"):
        pair.senders[0].add_room(1, SRC, src_swa_pages=[-1, PAGES])
    assert pair.recv.num_rooms() == 0 and pair.senders[0].num_rooms() == 0
