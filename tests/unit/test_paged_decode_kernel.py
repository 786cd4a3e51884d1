"""The C++ CPU paged decode kernel (kvpipe/model/cpu/kernels) against attend_pages, the torch
reference, on random pools: dtypes, GQA groups, head dims, page sizes, ragged rows (length 1,
page boundaries), padding pages, sinks, sliding windows (key_start > 0), MLA-shaped latent pages
(v a prefix view of k); pools stored in another dtype than q (bf16, fp16, fp8 e4m3 / e5m2 with
per-layer scales: --kv-cache-dtype), every fp8 code decoded exactly; and the fallbacks (disabled
by env, failed build)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.cache.kv_dtype import quantize
from kvpipe.cache.kv_pool import KVPool
from kvpipe.model.cpu.kernels import loader, paged_decode_kernel
from kvpipe.model.forward_batch import DecodeIndex, SeqSpan
from kvpipe.model.layers.attention import attend_pages, decode_attention

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.fixture(scope="module")
def kernel():
    k = paged_decode_kernel()
    assert k is not None, "the kernel did not build on this machine (g++ and ninja are needed)"
    return k


def make_index(gen: torch.Generator, lens: list[int], page: int, num_pages: int, window: int | None) -> DecodeIndex:
    """Rows of context `lens` on scattered pages of a pool of num_pages (page 0 left for padding)."""
    perm = torch.randperm(num_pages - 1, generator=gen) + 1
    seqs, used = [], 0
    for b, n in enumerate(lens):
        pages = -(-n // page)
        seqs.append(SeqSpan(b, 1, n - 1, perm[used : used + pages].clone()))
        used += pages
    return DecodeIndex.build(tuple(seqs), page, window)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: DecodeIndex,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """attend_pages on the gathered pages, dequantized (stored * scale), in fp32 (the kernel
    accumulates in fp32 too)."""
    b, n = index.batch_size, index.num_pages
    kp = (k.float() * k_scale).index_select(0, index.pages).view(b, n, *k.shape[1:])
    vp = (v.float() * v_scale).index_select(0, index.pages).view(b, n, *v.shape[1:])
    valid = index.valid if window is None else index.window_valid(window)
    return attend_pages(q.float(), kp, vp, valid, scale, None if sinks is None else sinks.float())


def check(
    kernel,
    dtype: torch.dtype,
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    page: int,
    window: int | None = None,
    sinks: bool = False,
    mla_v: int | None = None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """mla_v: v is k[..., :mla_v] (one latent head), as MLA decode passes it. kv_dtype: what the
    pool stores (default: q's dtype), values quantized with the scales as KVPool.write does."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    num_pages = sum(-(-n // page) for n in lens) + 3
    k = quantize(torch.randn(num_pages, kv_heads, page, head_dim, generator=gen) * 3, kv_dtype, k_scale)
    v = k[..., :mla_v] if mla_v is not None else quantize(torch.randn(k.shape, generator=gen), kv_dtype, v_scale)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    s = torch.randn(kv_heads * group, generator=gen) * 2 if sinks else None
    index = make_index(gen, lens, page, num_pages, window)
    scale = head_dim**-0.5
    out = kernel(q, k, v, index.page_table, index.lens, index.key_start, scale, window, s, k_scale, v_scale)
    assert out.dtype == dtype and out.shape == (len(lens), kv_heads * group, v.shape[-1])
    want = reference(q, k, v, index, scale, window, s, k_scale, v_scale)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@st.composite
def cases(draw: st.DrawFn) -> dict:
    page = draw(st.sampled_from([1, 4, 16, 64]))
    rows = draw(st.integers(1, 6))
    # lengths near page boundaries are the interesting ones
    lens = [max(1, draw(st.integers(0, 4)) * page + draw(st.integers(-1, 1))) for _ in range(rows)]
    lens = [draw(st.sampled_from([n, draw(st.integers(1, 150))])) for n in lens]
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        lens=lens,
        kv_heads=draw(st.sampled_from([1, 2, 4])),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.sampled_from([40, 64, 128])),
        page=page,
        window=draw(st.one_of(st.none(), st.integers(1, 100))),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=80, deadline=None)
@given(cases())
def test_kernel_matches_attend_pages(kernel, case: dict) -> None:
    check(kernel, **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_batch_33_page_boundaries(kernel, dtype: torch.dtype, group: int) -> None:
    # 33 rows: one task per (row, KV head) split over threads unevenly; lengths 1, P-1, P, P+1, ...
    lens = [1 + (i * 7) % 64 if i % 3 else 16 * (i % 5) + (i % 2) or 1 for i in range(33)]
    check(kernel, dtype, lens, kv_heads=2, group=group, head_dim=64, page=16)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("sinks", [False, True])
def test_windows_and_sinks(kernel, window: int | None, sinks: bool) -> None:
    # rows longer than the window index from the page the window starts in (key_start > 0)
    check(
        kernel,
        torch.float32,
        [1, 15, 16, 17, 63, 100],
        kv_heads=2,
        group=4,
        head_dim=64,
        page=16,
        window=window,
        sinks=sinks,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_mla_latent_pages(kernel, dtype: torch.dtype, page: int) -> None:
    # one latent head [C + rope] = 72 + 8, values its first C numbers, 16 query heads
    check(kernel, dtype, [1, 30, 64, 65, 129], kv_heads=1, group=16, head_dim=80, page=page, mla_v=72)


KV_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_quantized_pools_match_the_dequantized_reference(
    kernel, kv_dtype: torch.dtype, dtype: torch.dtype, head_dim: int
) -> None:
    """A pool stored in another dtype than q (--kv-cache-dtype): the kernel converts each row as
    it reads it and applies the scales (fp8 only; other pools always pass 1.0); the reference
    dequantizes the whole pool first. Same fp32 arithmetic otherwise: q's dtype's tolerance."""
    scales = (0.5, 3.0) if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else (1.0, 1.0)
    lens = [1, 15, 16, 17, 100]
    check(kernel, dtype, lens, 2, 3, head_dim, 16, kv_dtype=kv_dtype, k_scale=scales[0], v_scale=scales[1])
    check(kernel, dtype, lens, 2, 3, head_dim, 16, window=20, sinks=True, kv_dtype=kv_dtype, seed=1)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_quantized_mla_latent_pages(kernel, kv_dtype: torch.dtype) -> None:
    # the latent's one scale serves its keys and its values (the prefix view)
    check(kernel, torch.float32, [1, 30, 65], 1, 16, 80, 16, mla_v=72, kv_dtype=kv_dtype, k_scale=2.0, v_scale=2.0)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16], ids=str)
@pytest.mark.parametrize("width", [256, 261])  # whole 8-wide conversions, and a scalar tail
def test_every_stored_code_decodes_exactly(kernel, kv_dtype: torch.dtype, width: int) -> None:
    """One key per row: its softmax weight is exactly 1, so the output is the value row times
    v_scale, converted by the kernel. Every fp8 byte (every fp16 code of a sample) against
    torch's own conversion, bit for bit: subnormals, the largest finite values, signed zeros."""
    if kv_dtype == torch.float16:
        bits = torch.randint(
            -(1 << 15), 1 << 15, (width,), generator=torch.Generator().manual_seed(0), dtype=torch.int16
        )
    else:
        bits = (torch.arange(width) % 256).to(torch.uint8)
    bits = bits.clone()
    bits[~torch.isfinite(bits.view(kv_dtype).float())] = 0  # NaN / inf: a pool never holds them (writes saturate)
    row = bits.view(kv_dtype)
    v = row.view(1, 1, 1, width).expand(2, 1, 1, width).contiguous()
    k = torch.zeros(2, 1, 1, width, dtype=kv_dtype)
    q = torch.zeros(1, 1, width)
    one = torch.tensor([[1]])
    out = kernel(q, k, v, one, torch.tensor([1]), torch.tensor([0]), 1.0, None, None, 1.0, 0.75)
    assert torch.equal(out[0, 0], row.float() * 0.75)


BLOCK_EDGE_LENS = [1, 7, 8, 9, 23, 24, 25, 63, 64, 65, 150]  # around the 8-key blocks and the pages


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("head_dim", [36, 64, 100, 128])  # 36, 100: a tail beyond whole 8-float vectors
@pytest.mark.parametrize("page", [24, 64])  # 24: pages of 3 whole key blocks; 64: of 8
def test_blocked_path_edges(kernel, kv_dtype: torch.dtype, head_dim: int, page: int) -> None:
    """The kernel scores keys 8 at a time and accumulates values 64 then 8 columns at a time (with
    AVX2): rows ending inside a key block, windows starting inside one, head dims with a scalar
    tail; the same answers as the torch reference with or without a window and sinks."""
    scales = (0.5, 3.0) if kv_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    check(
        kernel,
        torch.float32,
        BLOCK_EDGE_LENS,
        2,
        3,
        head_dim,
        page,
        kv_dtype=kv_dtype,
        k_scale=scales[0],
        v_scale=scales[1],
    )
    check(
        kernel, torch.float32, BLOCK_EDGE_LENS, 2, 3, head_dim, page, window=13, sinks=True, kv_dtype=kv_dtype, seed=1
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("mla_v", [64, 68, 100])
def test_mla_prefix_values_with_tails(kernel, kv_dtype: torch.dtype, mla_v: int) -> None:
    # v = k[..., :mla_v] of 100-wide latent rows: pools other than fp32 convert each row once for
    # both. A scale (fp8's only) leaves fp32's keys as they are and doubles the reference's scores,
    # and with them the rounding that fp32's fixed tolerance has to cover: fp8 only, as KVPool does.
    scale = 2.0 if kv_dtype == torch.float8_e5m2 else 1.0
    check(
        kernel,
        torch.float32,
        BLOCK_EDGE_LENS,
        1,
        8,
        100,
        24,
        mla_v=mla_v,
        kv_dtype=kv_dtype,
        k_scale=scale,
        v_scale=scale,
    )


def test_v_the_same_tensor_as_k(kernel) -> None:
    # k and v one tensor (not MLA's prefix view, every column a value): read once, both roles
    gen = torch.Generator().manual_seed(5)
    kv = quantize(torch.randn(12, 2, 16, 64, generator=gen), torch.bfloat16)
    q = torch.randn(3, 6, 64, generator=gen)
    index = make_index(gen, [5, 17, 40], 16, 12, None)
    out = kernel(q, kv, kv, index.page_table, index.lens, index.key_start, 0.125)
    torch.testing.assert_close(out, reference(q, kv, kv, index, 0.125, None, None), **TOL[torch.float32])


def test_single_row_single_token(kernel) -> None:
    check(kernel, torch.float32, [1], kv_heads=4, group=3, head_dim=64, page=64)


def test_decode_attention_uses_kernel_and_env_disables_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_attention gives the same answer through the kernel and through the torch path."""
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, 20, 4, 2, 32)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    index = make_index(gen, [3, 9, 17], 4, 20, None)
    q = torch.randn(3, 4, 32, generator=gen)
    monkeypatch.setenv(loader.DISABLE_ENV, "1")
    assert paged_decode_kernel() is not None
    fast = decode_attention(q, 0, index, pool, 0.2)
    monkeypatch.setenv(loader.DISABLE_ENV, "0")
    assert paged_decode_kernel() is None
    torch.testing.assert_close(fast, decode_attention(q, 0, index, pool, 0.2), atol=1e-5, rtol=1e-5)


@pytest.fixture
def fresh_loader() -> Iterator[None]:
    loader.load_extension.cache_clear()
    yield
    loader.load_extension.cache_clear()  # the next caller loads the real kernel again


def test_failed_build_warns_once_and_falls_back(
    fresh_loader: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "paged_decode.cpp"
    broken.write_text('#error "this kernel does not compile"\n')
    monkeypatch.setattr(loader, "SOURCE", broken)
    monkeypatch.setenv(loader.DIR_ENV, str(tmp_path / "build"))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert paged_decode_kernel() is None
        assert paged_decode_kernel() is None  # memoised: no second build, no second warning
    warnings = [r for r in caplog.records if "torch path" in r.getMessage()]
    assert len(warnings) == 1
    assert (tmp_path / "build").is_dir()


def test_missing_compiler_falls_back(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(loader, "build", no_compiler)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert paged_decode_kernel() is None
    assert "g++: command not found" in caplog.text
