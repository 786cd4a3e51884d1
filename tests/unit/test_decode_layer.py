"""A decode step's layers as one C++ call each (model/cpu/fused_decode.py, cpu/kernels/decode_layer.cpp)
give the module path's bits: every logit and every stored K/V, one row and a batch of rows with
contexts of different lengths, in fp32 (panel, oneDNN-packed and dense weights), with int8 /
int4 weights and in bf16 (--dtype bfloat16: pair panels or dense weights, a bf16 pool); prefill
and anything the fused layers cannot run stay on the module path."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvpipe.commands.flags import add_http_api_args, add_server_args, server_config_from_args
from kvpipe.config import ConfigError, ServerConfig
from kvpipe.engine.model_runner import make_kv_pool
from kvpipe.model.checkpoint.loader import load_model
from kvpipe.model.cpu.fused_decode import FusedDecodeLayers, build_fused_decode
from kvpipe.model.cpu.kernels import loader as kernel_loader
from kvpipe.model.cpu.panel_weight import Bf16PanelWeight
from kvpipe.model.families.causal_lm import CausalLM
from kvpipe.model.forward_batch import ForwardBatch
from tests.helpers.hf_models import prompt_ids
from tests.helpers.paged_model import incremental_logits, make_pool

PAGE = 4


def _fused(model: CausalLM) -> FusedDecodeLayers:
    fused = model.fused_decode
    assert fused is not None and sorted(fused.layers) == list(range(model.cfg.num_layers))
    return fused


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("float32", "w8a16"), ("float32", "w4a16"), ("bfloat16", None)]
)
def test_one_row_logits_equal_the_module_path(tiny_model_dir, dtype, quantization) -> None:
    """Chunked prefill then decode steps: every position's logits the same bits."""
    model = load_model(tiny_model_dir, dtype=dtype, quantization=quantization, decode_fused_layer="on")
    fused = _fused(model)
    assert fused.dtype == getattr(torch, dtype)
    ids = prompt_ids(20, seed=5)
    model.fused_decode = None
    want = incremental_logits(model, ids, prompt_len=9, page_size=PAGE, chunk=5)
    model.fused_decode = fused
    got = incremental_logits(model, ids, prompt_len=9, page_size=PAGE, chunk=5)
    assert torch.equal(got, want)


@torch.no_grad()
def _batched_decode(model: CausalLM, steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Three rows (prompts of 3, 9 and 14 tokens, scattered pages) prefilled alone, then `steps`
    decode steps of the three together -> their logits [steps * 3, vocab] and the pool."""
    prompts = [prompt_ids(n, seed=n) for n in (3, 9, 14)]
    feed = prompt_ids(steps * 3, seed=11)
    tables = [torch.tensor(t) for t in ([7, 2, 12, 0, 5, 17], [1, 9, 3, 14, 8, 19], [4, 16, 6, 11, 10, 13])]
    pool = make_pool(model, 20, PAGE)
    for p, t in zip(prompts, tables):
        model(ForwardBatch.build([p], [0], [t], PAGE), pool)
    lens, out = [len(p) for p in prompts], []
    fused = model.fused_decode
    for s in range(steps):
        batch = ForwardBatch.build([[feed[3 * s + r]] for r in range(3)], lens, tables, PAGE)
        assert batch.decode is not None
        if fused is not None:  # the fused layers take this batch
            hidden = torch.zeros(3, model.cfg.hidden_size, dtype=fused.dtype)
            assert fused.takes(batch, pool, hidden, 0, model.cfg.num_layers)
        out.append(model(batch, pool))
        lens = [n + 1 for n in lens]
    return torch.cat(out), pool.k, pool.v


@pytest.mark.parametrize(
    ("dtype", "quantization", "form"),
    [
        *(("float32", q, f) for q in (None, "w4a16") for f in ("panel", "onednn", "dense")),
        ("bfloat16", None, "panel"),
        ("bfloat16", None, "dense"),
    ],
)
def test_a_batch_of_rows_equals_the_module_path(tiny_model_dir, monkeypatch, dtype, quantization, form) -> None:
    """Logits and every layer's stored K/V, bit for bit, whichever form the fp32 or bf16 weights take."""
    monkeypatch.setenv("KVPIPE_PACK_WEIGHTS", "0" if form == "dense" else "1")
    monkeypatch.setenv("KVPIPE_PANEL_WEIGHTS", "1" if form == "panel" else "0")
    model = load_model(tiny_model_dir, dtype=dtype, quantization=quantization, decode_fused_layer="on")
    qkv = model.layers[0].self_attn.qkv
    held = (
        "w4a16"
        if qkv.quant is not None
        else "panel"
        if qkv.panel is not None
        else "onednn"
        if qkv.weight.is_mkldnn
        else "dense"
    )
    assert held == (quantization or form)
    assert isinstance(qkv.panel, Bf16PanelWeight) == (dtype == "bfloat16" and form == "panel")
    fused = _fused(model)
    assert fused.dtype == getattr(torch, dtype)
    model.fused_decode = None
    want, want_k, want_v = _batched_decode(model, steps=6)
    model.fused_decode = fused
    got, got_k, got_v = _batched_decode(model, steps=6)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_k, want_k))
    assert all(torch.equal(a, b) for a, b in zip(got_v, want_v))


def test_what_the_fused_layers_do_not_take(tiny_model_dir, monkeypatch) -> None:
    model = load_model(tiny_model_dir, decode_fused_layer="auto")
    fused = _fused(model)
    n, hidden = model.cfg.num_layers, torch.zeros(1, model.cfg.hidden_size)
    pool = make_pool(model, 4, PAGE)
    table = torch.arange(4)
    prefill = ForwardBatch.build([[1, 2, 3]], [0], [table], PAGE)
    decode = ForwardBatch.build([[1]], [3], [table], PAGE)
    assert not fused.takes(prefill, pool, hidden, 0, n)
    assert fused.takes(decode, pool, hidden, 0, n)
    assert not fused.takes(decode, pool, hidden.bfloat16(), 0, n)
    bf16_pool = make_kv_pool(model, 4, PAGE, window_tables=False, kv_cache_dtype="bfloat16")
    assert not fused.takes(decode, bf16_pool, hidden, 0, n)
    assert fused.max_batch is not None and build_fused_decode(model, "on").max_batch is None  # type: ignore[union-attr]
    assert load_model(tiny_model_dir, decode_fused_layer="off").fused_decode is None
    bf16 = load_model(tiny_model_dir, dtype="bfloat16", decode_fused_layer="on")  # a bf16 model takes bf16 only
    fused_bf16 = _fused(bf16)
    assert fused_bf16.dtype == torch.bfloat16
    bf16_pool = make_kv_pool(bf16, 4, PAGE, window_tables=False)  # --kv-cache-dtype auto: bf16
    assert fused_bf16.takes(decode, bf16_pool, hidden.bfloat16(), 0, n)
    assert not fused_bf16.takes(decode, bf16_pool, hidden, 0, n)
    fp8_pool = make_kv_pool(bf16, 4, PAGE, window_tables=False, kv_cache_dtype="fp8_e4m3")
    assert not fused_bf16.takes(decode, fp8_pool, hidden.bfloat16(), 0, n)
    monkeypatch.setenv(kernel_loader.DISABLE_ENV, "0")
    assert build_fused_decode(model, "on") is None
    with pytest.raises(ValueError, match="decode_fused_layer"):
        build_fused_decode(model, "always")
    with pytest.raises(ConfigError, match="decode_fused_layer"):
        ServerConfig(model_path="m", decode_fused_layer="always")


@pytest.mark.parametrize(("argv", "want"), [([], "auto"), (["--decode-fused-layer", "off"], "off")])
def test_decode_fused_layer_flag(tmp_path, argv: list[str], want: str) -> None:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_http_api_args(p)
    assert server_config_from_args(p.parse_args(["--model-path", str(tmp_path), *argv])).decode_fused_layer == want
