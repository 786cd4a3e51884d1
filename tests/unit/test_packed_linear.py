"""Packed fp32 Linear weights, in both forms: column panels (panel_weight.py, the default where
the kernels build) and oneDNN's (packed_linear.py, KVPIPE_PANEL_WEIGHTS=0). The same products as
F.linear within the bound of any summation order, nothing lost, a row's bits the same alone, in a
batch and on any thread count, packed at load time (except the weights other code reads dense,
and the tied logits get a panel copy), and off with KVPIPE_PACK_WEIGHTS=0."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.cpu.packed_linear import can_pack, packing_enabled
from kvpipe.model.cpu.panel_weight import PanelWeight, panel_kernels
from kvpipe.model.layers.linear import Linear
from kvpipe.model.presets import write_preset
from tests.helpers.tolerance import matmul_bound

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
FORMS = ["panel", "onednn"]


@contextmanager
def packing_as(form: str) -> Iterator[None]:
    with mock.patch.dict(os.environ, {"KVPIPE_PANEL_WEIGHTS": "1" if form == "panel" else "0"}):
        if form == "panel" and panel_kernels() is None:
            pytest.skip("the C++ kernels are not built")
        yield


def _linear(rows_out: int, cols_in: int, bias: bool, seed: int) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(cols_in, rows_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(rows_out, cols_in, generator=g) / cols_in**0.5)
        if bias:
            lin.bias.copy_(torch.randn(rows_out, generator=g))
    return lin, lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 300),
    cols_in=st.integers(1, 200),
    rows_out=st.integers(1, 200),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_dense(form: str, rows: int, cols_in: int, rows_out: int, bias: bool, seed: int) -> None:
    with packing_as(form):
        lin, w, b = _linear(rows_out, cols_in, bias, seed)
        assert lin.pack() and lin.form == form
    x = torch.randn(rows, cols_in, generator=torch.Generator().manual_seed(seed + 1))
    y = lin(x)
    assert y.shape == (rows, rows_out) and y.dtype == torch.float32
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bias_rounding = 0 if b is None else torch.finfo(torch.float32).eps * exact.abs()
    assert bool(((y.double() - exact).abs() <= matmul_bound(x, w) + bias_rounding).all())
    assert torch.equal(lin.dense_weight(), w)  # packing loses nothing


@pytest.mark.parametrize("form", FORMS)
def test_row_gives_same_bits_alone_and_in_a_batch(form: str) -> None:
    with packing_as(form):
        lin, _, _ = _linear(520, 256, True, 0)  # 520: a partial last panel
        lin.pack()
    x = torch.randn(37, 256)
    batched = lin(x)
    for i in (0, 17, 36):
        assert torch.equal(lin(x[i : i + 1])[0], batched[i])
    for n in (5, 6, 7, 12):
        assert torch.equal(lin(x[:n]), batched[:n])


def test_panel_bits_do_not_depend_on_the_thread_count() -> None:
    with packing_as("panel"):
        lin, _, _ = _linear(300, 96, False, 3)
        lin.pack()
    x = torch.randn(23, 96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        assert torch.equal(lin(x), one)
    finally:
        torch.set_num_threads(threads)


def test_panel_weight_refuses_what_does_not_fit() -> None:
    ext = panel_kernels()
    if ext is None:
        pytest.skip("the C++ kernels are not built")
    pw = int(ext.f32_panel_width())
    with pytest.raises(ValueError, match="panels"):
        PanelWeight(torch.zeros(2, 8, pw + 1), 2 * pw, ext)
    with pytest.raises(ValueError, match="do not fill"):
        PanelWeight(torch.zeros(2, 8, pw), pw, ext)  # the second panel would be empty
    with pytest.raises(RuntimeError, match="K = 8"):
        PanelWeight.pack(torch.zeros(pw, 8), ext)(torch.zeros(1, 9))


@pytest.mark.parametrize("form", FORMS)
def test_leading_dims_and_strided_input(form: str) -> None:
    with packing_as(form):
        lin, w, _ = _linear(48, 32, False, 1)
        lin.pack()
    x = torch.randn(3, 5, 64)[..., ::2]  # [3, 5, 32], not contiguous
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_only_cpu_fp32_dense_weights_pack() -> None:
    assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    assert not can_pack(torch.zeros(4))
    lin = Linear(4, 4, packable=False)
    assert not lin.pack() and lin.form == "dense"


@pytest.mark.parametrize("form", FORMS)
def test_loader_packs_every_linear_but_mla_kv_b(tiny_model_dir, tmp_path, form: str) -> None:
    assert packing_enabled()
    with packing_as(form):
        m = load_model(tiny_model_dir)
        mla = load_model(write_preset("tiny-deepseek-v3", tmp_path))
    # q/k/v and gate/up were fused first (fused_projections.py): their parts hold empty weights
    linears = [x for x in m.modules() if isinstance(x, Linear) and (x.weight.numel() or x.panel is not None)]
    assert linears and all(x.form == form for x in linears)
    qkv = m.layers[0].self_attn.qkv
    assert qkv.dense_weight().shape == ((4 + 2 + 2) * 32, 128)
    assert mla.layers[0].self_attn.kv_b_proj.form == "dense"
    assert mla.layers[0].self_attn.o_proj.form == form


@pytest.mark.parametrize("form", FORMS)
def test_tied_logits_take_a_panel_copy_of_the_table(tmp_path, form: str) -> None:
    """The lookup keeps the dense table; the logits multiply a panel copy (none with oneDNN's form)."""
    d = write_preset("tiny", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with packing_as(form):
        m = load_model(d)
    assert m.lm_head is None and (m.head_panel is not None) == (form == "panel")
    if m.head_panel is not None:
        assert torch.equal(m.head_panel.dense(), m.embed_tokens)
        h = torch.randn(3, m.cfg.hidden_size)
        exact = h.double() @ m.embed_tokens.double().T
        assert bool(((m.head_panel(h).double() - exact).abs() <= matmul_bound(h, m.embed_tokens)).all())


def test_env_keeps_dense_weights(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("KVPIPE_PACK_WEIGHTS", "0")
    m = load_model(tiny_model_dir)
    assert all(x.form == "dense" for x in m.modules() if isinstance(x, Linear)) and m.head_panel is None
