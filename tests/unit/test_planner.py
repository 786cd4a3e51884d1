"""Planner: run splitting, op counts, and real copies between KVPools through the local backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.transfer.backends.base import BatchState
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import page_runs, plan_pages, sendable_pages
from kvpipe.transfer.planning.tp_mapping import kv_head_range, slices_for_decode_rank, transfer_slices

LAYERS, PAGES, PAGE, HD = 3, 24, 4, 8


def make_pool(kv_heads: int, fill: bool, seed: int = 0, dtype=torch.float32) -> KVPool:
    pool = KVPool(LAYERS, PAGES, PAGE, kv_heads, HD, dtype=dtype)
    if fill:
        g = torch.Generator().manual_seed(seed)
        for buf in pool.k + pool.v:
            buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    return pool


class Pair:
    """Two pools registered in two local backends on one fabric."""

    def __init__(self, src: KVPool, dst: KVPool) -> None:
        fabric = LocalFabric()
        self.tx, self.rx = LocalBackend(fabric), LocalBackend(fabric)
        for be, pool in ((self.tx, src), (self.rx, dst)):
            infos = pool.buffer_infos()
            be.register_many([b.addr for b in infos], [b.nbytes for b in infos])

    def run(self, plan) -> None:
        h = self.tx.submit(self.rx.address, plan.src_addr, plan.dst_addr, plan.length)
        assert self.tx.wait(h) is BatchState.DONE, h.error


def copy_and_check(src_pages, dst_pages, expect_runs: int) -> None:
    src, dst = make_pool(2, True), make_pool(2, False)
    ls, ld = KVLayout.from_pool(src), KVLayout.from_pool(dst)
    plan = plan_pages(src_pages, dst_pages, ls, ld)
    assert plan.num_runs == expect_runs
    assert plan.num_ops == LAYERS * 2 * expect_runs
    assert plan.nbytes == len(src_pages) * ls.page_nbytes * 2 * LAYERS
    assert plan.planning_ms >= 0.0
    Pair(src, dst).run(plan)
    untouched = np.setdiff1d(np.arange(PAGES), dst_pages)
    for layer in range(LAYERS):
        for s, d in ((src.k[layer], dst.k[layer]), (src.v[layer], dst.v[layer])):
            assert torch.equal(d[list(dst_pages)], s[list(src_pages)])
            assert not d[untouched].any()


def test_contiguous_is_one_run():
    copy_and_check(list(range(0, 10)), list(range(5, 15)), expect_runs=1)


def test_fragmented_source_splits_runs():
    copy_and_check([0, 1, 2, 5, 6, 9], [3, 4, 5, 6, 7, 8], expect_runs=3)


def test_fragmented_destination_splits_runs():
    copy_and_check([4, 5, 6, 7, 8], [10, 11, 2, 3, 20], expect_runs=3)


def test_both_sides_fragmented_and_reversed():
    copy_and_check([9, 8, 7, 1, 2], [0, 1, 2, 3, 4], expect_runs=4)


def test_page_runs_boundaries():
    s, d, n = page_runs(np.array([0, 1, 2, 3]), np.array([7, 8, 20, 21]))
    assert s.tolist() == [0, 2] and d.tolist() == [7, 20] and n.tolist() == [2, 2]
    assert all(x.size == 0 for x in page_runs(np.zeros(0, np.int64), np.zeros(0, np.int64)))


def test_layer_subplan_copies_only_those_layers():
    src, dst = make_pool(2, True), make_pool(2, False)
    plan = plan_pages([1, 2, 3], [4, 5, 6], KVLayout.from_pool(src), KVLayout.from_pool(dst))
    sub = plan.layers(1, 2)
    assert sub.num_ops == 2 and (sub.layer_start, sub.layer_end) == (1, 2)
    Pair(src, dst).run(sub)
    assert torch.equal(dst.k[1][4:7], src.k[1][1:4]) and torch.equal(dst.v[1][4:7], src.v[1][1:4])
    assert not dst.k[0].any() and not dst.k[2].any() and not dst.v[2].any()
    # planning a layer range directly gives the same ops
    direct = plan_pages([1, 2, 3], [4, 5, 6], KVLayout.from_pool(src), KVLayout.from_pool(dst), layers=(1, 2))
    assert np.array_equal(direct.src_addr, sub.src_addr) and np.array_equal(direct.length, sub.length)


def test_plan_rejects_bad_input():
    src, dst = KVLayout.from_pool(make_pool(2, False)), KVLayout.from_pool(make_pool(2, False))
    with pytest.raises(ValueError, match="source pages"):
        plan_pages([1, 2], [3], src, dst)
    with pytest.raises(ValueError, match="outside"):
        plan_pages([PAGES], [0], src, dst)
    with pytest.raises(ValueError, match="duplicate"):
        plan_pages([1, 2], [3, 3], src, dst)
    other = KVLayout.from_pool(KVPool(LAYERS, PAGES, PAGE * 2, 2, HD))
    with pytest.raises(ValueError, match="page size"):
        plan_pages([1], [1], src, other)
    half = KVLayout.from_pool(make_pool(2, False, dtype=torch.float16))
    assert "dtype" in src.compatible_with(half)
    assert "layers" in src.compatible_with(KVLayout.from_pool(KVPool(LAYERS + 1, PAGES, PAGE, 2, HD)))
    assert "head_dim" in src.compatible_with(KVLayout.from_pool(KVPool(LAYERS, PAGES, PAGE, 2, HD * 2)))
    assert src.compatible_with(dst) is None


def test_sendable_pages():
    assert sendable_pages(0, 10, 4, final=False) == sendable_pages(0, 8, 4, final=False)
    span = sendable_pages(0, 10, 4, final=False)
    assert (span.first, span.end, span.token_end) == (0, 2, 8)  # trailing partial page waits
    span = sendable_pages(8, 10, 4, final=True)
    assert (span.first, span.end, span.token_end) == (2, 3, 10)
    assert sendable_pages(8, 11, 4, final=False).num_pages == 0
    with pytest.raises(ValueError):
        sendable_pages(6, 10, 4, final=False)  # cursor must be page aligned


# ---- heterogeneous TP -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)  # 4- and 1-byte elements
@pytest.mark.parametrize("P,D,H", [(1, 2, 4), (2, 1, 4), (1, 4, 2), (4, 2, 2), (4, 2, 8), (2, 4, 2), (8, 2, 2)])
def test_heterogeneous_tp_gives_each_decode_rank_its_heads(P, D, H, dtype):
    g = torch.Generator().manual_seed(P * 100 + D * 10 + H)
    full = [torch.randn((PAGES, H, PAGE, HD), generator=g).to(dtype) for _ in range(2 * LAYERS)]  # K0 V0 K1 V1..
    prefill, decode = [], []
    for tp, pools in ((P, prefill), (D, decode)):
        for r in range(tp):
            a, b = kv_head_range(tp, r, H)
            pool = make_pool(b - a, False, dtype=dtype)
            if pools is prefill:
                for i, buf in enumerate(x for layer in range(LAYERS) for x in (pool.k[layer], pool.v[layer])):
                    buf.copy_(full[i][:, a:b])
            pools.append((pool, KVLayout.from_pool(pool, head_start=a, total_kv_heads=H)))
    src_pages, dst_pages = [3, 4, 5, 9, 10], [0, 1, 2, 3, 4]
    fabric = LocalFabric()
    tx = [LocalBackend(fabric) for _ in range(P)]
    rx = [LocalBackend(fabric) for _ in range(D)]
    for be, (pool, _) in zip(tx + rx, prefill + decode):
        infos = pool.buffer_infos()
        be.register_many([b.addr for b in infos], [b.nbytes for b in infos])
    writes = np.zeros((D, H), dtype=int)  # how often each decode head gets written
    for s in transfer_slices(P, D, H):
        (_, ls), (_, ld) = prefill[s.prefill_rank], decode[s.decode_rank]
        plan = plan_pages(src_pages, dst_pages, ls, ld, heads=(s.head_start, s.head_end))
        whole = s.num_heads == ls.kv_heads == ld.kv_heads
        assert plan.num_runs == (2 if whole else len(src_pages))  # coalesce only whole pages
        # bytes follow the element size: head slices of PAGE tokens x HD elements, K and V, each layer
        assert plan.nbytes == len(src_pages) * s.num_heads * PAGE * HD * dtype.itemsize * 2 * LAYERS
        h = tx[s.prefill_rank].submit(rx[s.decode_rank].address, plan.src_addr, plan.dst_addr, plan.length)
        assert h.state is BatchState.DONE, h.error
        writes[s.decode_rank, s.head_start : s.head_end] += 1
    for r, (pool, layout) in enumerate(decode):
        a, b = layout.head_start, layout.head_end
        assert (writes[r, a:b] == 1).all() and writes[r].sum() == b - a  # each head exactly once
        for i, buf in enumerate(x for layer in range(LAYERS) for x in (pool.k[layer], pool.v[layer])):
            raw = buf.view(torch.uint8)  # bytes: fp8 has few torch ops
            assert torch.equal(raw[dst_pages], full[i][src_pages, a:b].contiguous().view(torch.uint8))
            assert not raw[5:].any()


def _sglang_offsets(p_rank: int, d_rank: int, P: int, D: int, H: int) -> tuple[int, int, int]:
    """SGLang's head-slicing formulas (docs/architecture.md, rank mapping and head slicing):
    (prefill head offset, decode head offset, heads moved)."""
    src_h, dst_h = max(1, H // P), max(1, H // D)
    if P > D:
        unique_p = (p_rank % P) // max(1, P // H)
        return 0, (unique_p * src_h) % dst_h, src_h
    unique_d = (d_rank % D) // max(1, D // H)
    return (unique_d * dst_h) % src_h, 0, dst_h


@pytest.mark.parametrize("H", [1, 2, 4, 8])
def test_head_slices_match_design_formulas(H):
    for P in (1, 2, 4, 8):
        for D in (1, 2, 4, 8):
            for d in range(D):
                dst = kv_head_range(D, d, H)
                for s in slices_for_decode_rank(d, P, D, H):
                    src = kv_head_range(P, s.prefill_rank, H)
                    got = (s.head_start - src[0], s.head_start - dst[0], s.num_heads)
                    assert got == _sglang_offsets(s.prefill_rank, d, P, D, H), (P, D, H, d, s)


def test_latent_pool_plans_one_op_per_layer_and_run_and_layer_slices():
    """MLA: one latent buffer per layer, so a run is `layers` ops (not 2x), and layer-group
    sub-plans index the op arrays by that stride."""
    width = 12  # kv_lora_rank + rope dims
    src, dst = (KVPool(LAYERS, PAGES, PAGE, 1, width, latent=True) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    for buf in src.buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    ls, ld = KVLayout.from_pool(src), KVLayout.from_pool(dst)
    src_pages, dst_pages = [2, 3, 4, 9], [7, 8, 9, 1]
    plan = plan_pages(src_pages, dst_pages, ls, ld)
    assert (plan.num_runs, plan.ops_per_layer, plan.num_ops) == (2, 2, LAYERS * 2)
    assert plan.nbytes == len(src_pages) * PAGE * width * 4 * LAYERS
    mid = plan.layers(1, 2)
    assert mid.num_ops == 2 and set(mid.dst_addr - ld.buffer_addrs[1]) < set(range(ld.buffer_nbytes))
    Pair(src, dst).run(plan)
    for s, d in zip(src.buffers(), dst.buffers(), strict=True):
        assert torch.equal(d[dst_pages], s[src_pages])
