"""The decode step's fewer calls give the same bits: fused q/k/v and gate/up projections
(fused_projections.py) against the parts alone, in every weight form (dense, oneDNN-packed,
int8, int4), RMSNorm through torch's rms_norm against HF's formula, RoPE + KV store in one call
(cpu/kernels/rope_store.cpp) against apply_rope and KVPool.write, and the loader's fused model
against the unfused one, logits bit for bit, with and without the C++ kernels."""

from __future__ import annotations

import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.cpu.fused_projections import fuse_linears
from kvpipe.model.cpu.kernels import loader as kernel_loader
from kvpipe.model.cpu.kernels.rope_store import rope_store_kernel
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.norms import RMSNorm
from kvpipe.model.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq
from kvpipe.model.quant.weights import Int4Weight, Int8Weight
from tests.helpers.hf_models import prompt_ids
from tests.helpers.paged_model import incremental_logits


def _parts(sizes: tuple[int, ...], k: int, bias: bool, seed: int) -> list[Linear]:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in sizes:
        lin = Linear(k, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        parts.append(lin)
    return parts


def _in_form(parts: list[Linear], form: str) -> list[Linear]:
    for p in parts:
        if form == "int8":
            p.quantize(Int8Weight.quantize(p.weight))
        elif form == "int4":
            p.quantize(Int4Weight.quantize(p.weight))
    return parts


@pytest.mark.parametrize("form", ["dense", "packed", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fused_equals_the_parts_bit_for_bit(form: str, rows: int) -> None:
    """q/k/v-like parts against their fused Linear."""
    sizes, k, bias = (128, 48, 48), 96, form != "int4"
    alone = _in_form(_parts(sizes, k, bias, seed=rows), form)
    if form == "packed":
        assert all(p.pack() for p in alone)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    want = torch.cat([p(x) for p in alone], dim=-1)
    parts = _in_form(_parts(sizes, k, bias, seed=rows), form)
    fused = fuse_linears(parts)
    assert fused is not None and all(p.weight.numel() == 0 and p.quant is None for p in parts)
    if form == "packed":
        assert fused.pack()
    assert torch.equal(fused(x), want)


def test_parts_that_cannot_share_a_call_stay_apart() -> None:
    mixed = _parts((32, 32), 64, bias=False, seed=0)
    mixed[0].quantize(Int8Weight.quantize(mixed[0].weight))
    assert fuse_linears(mixed) is None and mixed[1].weight.numel() > 0
    kinds = _parts((48, 64), 64, bias=False, seed=1)
    kinds[0].quantize(Int4Weight.quantize(kinds[0].weight))
    kinds[1].quantize(Int8Weight.quantize(kinds[1].weight))
    assert fuse_linears(kinds) is None and all(p.quant is not None for p in kinds)
    some_bias = _parts((32,), 64, bias=True, seed=2) + _parts((32,), 64, bias=False, seed=3)
    assert fuse_linears(some_bias) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # torch's rms_norm in fp32 only
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rms_norm_is_hf_formula_bit_for_bit(dtype: torch.dtype, scale: float) -> None:
    norm = RMSNorm(576, 1e-5).to(dtype)
    g = torch.Generator().manual_seed(int(scale * 1000) % 97)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    x = (torch.randn(7, 576, generator=g) * scale).to(dtype)
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # HF LlamaRMSNorm
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # a bf16 model with its bf16 pool too
def test_rope_store_is_apply_rope_and_pool_write_bit_for_bit(dtype: torch.dtype) -> None:
    ext = rope_store_kernel()
    assert ext is not None
    t, hq, hkv, d = 7, 9, 3, 64
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    cos, sin = rope_cos_sin(rope_inv_freq(d, 100000.0), torch.tensor([0, 5, 100, 1000, 7, 8, 9]), dtype)
    pages, offsets = torch.tensor([3, 3, 5, 1, 0, 19, 2]), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    want_pool, got_pool = (KVPool(1, 20, 4, hkv, d, dtype=dtype) for _ in range(2))
    heads = qkv.view(t, hq + 2 * hkv, d)
    want = apply_rope(heads[:, : hq + hkv], cos, sin)
    want_pool.write(0, pages, offsets, want[:, hq:], heads[:, hq + hkv :])
    got = ext.rope_store(qkv, cos, sin, got_pool.k[0], got_pool.v[0], pages, offsets, hq, hkv)
    assert torch.equal(got, want)
    assert torch.equal(got_pool.k[0], want_pool.k[0]) and torch.equal(got_pool.v[0], want_pool.v[0])
    with pytest.raises(RuntimeError, match="outside the pool"):
        ext.rope_store(qkv, cos, sin, got_pool.k[0], got_pool.v[0], pages + 20, offsets, hq, hkv)


@pytest.mark.parametrize("quantization", [None, "w4a16"])
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_fused_model_logits_equal_the_unfused_ones(tiny_model_dir, monkeypatch, quantization, kernels) -> None:
    """Prefill in chunks then decode steps through the paged pool: every logit the same bits."""
    monkeypatch.setenv(kernel_loader.DISABLE_ENV, kernels)
    ids = prompt_ids(20, seed=3)
    fused = load_model(tiny_model_dir, quantization=quantization)
    assert fused.layers[0].self_attn.qkv is not None and fused.layers[0].mlp.gate_up is not None
    monkeypatch.setenv("KVPIPE_FUSE_PROJECTIONS", "0")
    apart = load_model(tiny_model_dir, quantization=quantization)
    assert apart.layers[0].self_attn.qkv is None
    got = incremental_logits(fused, ids, prompt_len=9, page_size=4, chunk=5)
    want = incremental_logits(apart, ids, prompt_len=9, page_size=4, chunk=5)
    assert torch.equal(got, want)
