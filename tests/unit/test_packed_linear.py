"""oneDNN-packed Linear weights: same products as F.linear, row-invariant, packed at load time
(except the weights other code reads dense), and off with KVPIPE_PACK_WEIGHTS=0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.model.linear import Linear
from kvpipe.model.loader import load_model
from kvpipe.model.packed_linear import can_pack, packing_enabled
from kvpipe.model.presets import write_preset

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _linear(rows_out: int, cols_in: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(cols_in, rows_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows_out, cols_in, generator=g) / cols_in**0.5)
        if bias:
            lin.bias.copy_(torch.randn(rows_out, generator=g))
    return lin, lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 300),
    cols_in=st.integers(1, 200),
    rows_out=st.integers(1, 200),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_dense(rows: int, cols_in: int, rows_out: int, bias: bool, seed: int) -> None:
    lin, w, b = _linear(rows_out, cols_in, bias, seed)
    assert lin.pack() and lin.weight.is_mkldnn
    x = torch.randn(rows, cols_in, generator=torch.Generator().manual_seed(seed + 1))
    y = lin(x)
    assert y.shape == (rows, rows_out) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lin.weight.to_dense(), w, atol=0, rtol=0)  # packing loses nothing


def test_row_gives_same_bits_alone_and_in_a_batch() -> None:
    lin, _, _ = _linear(512, 256, True, 0)
    lin.pack()
    x = torch.randn(37, 256)
    batched = lin(x)
    for i in (0, 17, 36):
        assert torch.equal(lin(x[i : i + 1])[0], batched[i])


def test_leading_dims_and_strided_input() -> None:
    lin, w, _ = _linear(48, 32, False, 1)
    lin.pack()
    x = torch.randn(3, 5, 64)[..., ::2]  # [3, 5, 32], not contiguous
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_only_cpu_fp32_dense_weights_pack() -> None:
    assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not can_pack(torch.zeros(4))
    lin = Linear(4, 4, packable=False)
    assert not lin.pack() and not lin.weight.is_mkldnn


def test_loader_packs_every_linear_but_mla_kv_b(tiny_model_dir, tmp_path) -> None:
    assert packing_enabled()
    m = load_model(tiny_model_dir)
    # q/k/v and gate/up were fused first (fused_projections.py): their parts hold empty weights
    linears = [x for x in m.modules() if isinstance(x, Linear) and x.weight.numel()]
    assert linears and all(x.weight.is_mkldnn for x in linears)
    assert m.layers[0].self_attn.qkv.weight.shape == ((4 + 2 + 2) * 32, 128)  # shape and dtype stay readable
    mla = load_model(write_preset("tiny-deepseek-v3", tmp_path))
    assert not mla.layers[0].self_attn.kv_b_proj.weight.is_mkldnn
    assert mla.layers[0].self_attn.o_proj.weight.is_mkldnn


def test_env_keeps_dense_weights(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("KVPIPE_PACK_WEIGHTS", "0")
    m = load_model(tiny_model_dir)
    assert not any(x.weight.is_mkldnn for x in m.modules() if isinstance(x, Linear))
