import pytest
import torch

from kvpipe.cache.kv_pool import KVPool


def test_write_then_gather_roundtrip_across_pages():
    pool = KVPool(num_layers=2, num_pages=6, page_size=4, kv_heads=2, head_dim=3)
    table = torch.tensor([5, 1, 3])  # a non-contiguous page table
    n = 10
    pos = torch.arange(n)
    k = torch.randn(n, 2, 3)
    v = torch.randn(n, 2, 3)
    pool.write(1, table[pos // 4], pos % 4, k, v)
    gk, gv = pool.gather(1, table, n)
    assert gk.shape == (2, n, 3)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    # layer 0 untouched, pages not in the table untouched
    assert pool.k[0].abs().sum() == 0
    assert pool.k[1][[0, 2, 4]].abs().sum() == 0


def test_layout_is_page_then_head_major():
    pool = KVPool(1, 3, page_size=4, kv_heads=2, head_dim=5)
    k = torch.arange(2 * 5, dtype=torch.float32).reshape(1, 2, 5)
    pool.write(0, torch.tensor([2]), torch.tensor([3]), k, k + 100)
    # [num_pages, kv_heads, page_size, head_dim]: head h of token 3 in page 2
    assert torch.equal(pool.k[0][2, 1, 3], k[0, 1])
    assert torch.equal(pool.v[0][2, 0, 3], k[0, 0] + 100)


def test_buffer_infos_describe_raw_memory():
    pool = KVPool(3, 4, page_size=8, kv_heads=2, head_dim=16, dtype=torch.float16)
    infos = pool.buffer_infos()
    assert [(i.layer, i.kind) for i in infos] == [(layer, kv) for layer in range(3) for kv in ("k", "v")]
    page = 2 * 8 * 16 * 2
    assert all(i.page_nbytes == page and i.head_nbytes == 8 * 16 * 2 and i.nbytes == 4 * page for i in infos)
    assert infos[0].addr == pool.k[0].data_ptr() and infos[1].addr == pool.v[0].data_ptr()
    assert pool.nbytes == 6 * 4 * page
    # one page is contiguous: byte offset of page p = p * page_nbytes
    assert pool.k[2][3].data_ptr() - pool.k[2].data_ptr() == 3 * page


def test_sliding_layers_share_tensors_with_full_layers():
    """GPT-OSS's pattern (sliding, full, ...): the n-th sliding and n-th full layer share one K and
    one V tensor, so the pool allocates half the bytes; an odd count leaves one unshared."""
    pool = KVPool(5, 4, page_size=2, kv_heads=1, head_dim=3, swa_layers=(0, 2, 4))
    assert pool.tensor_of_layer() == [0, 0, 1, 1, 2] and pool.num_tensors == 3
    assert pool.k[0] is pool.k[1] and pool.v[2] is pool.v[3] and pool.k[4] is not pool.k[3]
    one = pool.k[0].numel() * pool.k[0].element_size()
    assert pool.nbytes == 3 * 2 * one
    # the layers keep their own pages: a write to page 1 of layer 0 shows in layer 1's page 1 only
    pool.write(0, torch.tensor([1]), torch.tensor([0]), torch.ones(1, 1, 3), torch.ones(1, 1, 3))
    assert pool.k[1][1].sum() == 3 and pool.k[1][0].sum() == 0
    with pytest.raises(ValueError, match="sliding layers"):
        KVPool(2, 4, page_size=2, kv_heads=1, head_dim=3, swa_layers=(1, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_quantized_pool_stores_its_dtype_and_reads_back_the_dequantized_values(dtype):
    """--kv-cache-dtype: the pool holds `dtype` (1 or 2 bytes an element, what the transfer
    moves), writes take the model's fp32 K/V, reads give fp32 back: stored * scale, where an fp8
    pool stores value / scale rounded to its format and saturated at its largest finite value."""
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_scales, v_scales = ((0.5, 4.0), (2.0, 0.25)) if fp8 else (None, None)
    pool = KVPool(2, 6, 4, 2, 8, dtype, compute_dtype=torch.float32, k_scales=k_scales, v_scales=v_scales)
    assert pool.k[1].dtype == dtype and pool.k[0].element_size() == dtype.itemsize
    assert pool.buffer_infos()[0].page_nbytes == 2 * 4 * 8 * dtype.itemsize
    table, n = torch.tensor([5, 1, 3]), 10
    pos = torch.arange(n)
    k, v = torch.randn(n, 2, 8) * 3, torch.randn(n, 2, 8)
    k[0, 0, 0] = 1e6  # beyond the range of fp16 and fp8 (not of bf16)
    pool.write(1, table[pos // 4], pos % 4, k, v)
    gk, gv = pool.gather(1, table, n)
    assert gk.dtype == torch.float32 and gk.shape == (2, n, 8)
    ks, vs = (4.0, 0.25) if fp8 else (1.0, 1.0)
    fmax = torch.finfo(dtype).max
    want_k = (k / ks).clamp(-fmax, fmax).to(dtype).float() * ks
    assert torch.equal(gk, want_k.transpose(0, 1))
    assert torch.equal(gv, (v / vs).to(dtype).float().mul(vs).transpose(0, 1))
    assert gk[0, 0, 0] == min(fmax * ks, want_k[0, 0, 0])  # saturated, not inf or NaN
    assert torch.isfinite(gk).all()
    # the torch decode path's page reads dequantize the same way
    pages = pool.read_pages(1, table, "v")
    assert torch.equal(pages.transpose(1, 2).reshape(-1, 2, 8)[:n], gv.transpose(0, 1))
    # the error is the format's: a wrong scale or a skipped cast would be far off
    assert (gv.transpose(0, 1) - v).abs().max() <= v.abs().max() * torch.finfo(dtype).eps


def test_kv_scales_are_fp8_only_and_positive():
    with pytest.raises(ValueError, match="fp8 pools only"):
        KVPool(1, 2, 4, 1, 8, torch.bfloat16, k_scales=(2.0,))
    with pytest.raises(ValueError, match="positive finite"):
        KVPool(1, 2, 4, 1, 8, torch.float8_e4m3fn, k_scales=(0.0,))
    with pytest.raises(ValueError, match="positive finite"):
        KVPool(2, 2, 4, 1, 8, torch.float8_e4m3fn, v_scales=(1.0,))
