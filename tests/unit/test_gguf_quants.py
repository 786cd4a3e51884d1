"""GGUF tensors: every supported storage type read back exactly (dequantized as gguf-py does, in
HF layout), llama's q/k permutation undone and qwen2/qwen3's left alone, row slices, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.checkpoint.gguf.reader import SUPPORTED_TYPES
from kvpipe.model.registry import model_config
from tests.helpers.gguf_files import Q, Shape, write_gguf

TYPES = sorted(SUPPORTED_TYPES, key=int)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_round_trips(tmp_path, qtype):
    w = write_gguf(tmp_path / "m.gguf", "llama", qtype)
    ck = GGUFCheckpoint.open(w.path)
    sd = ck.state_dict(progress=False)
    assert set(sd) == set(w.expected)
    for name, want in w.expected.items():
        assert ck.tensors[name].ggml_type == w.stored_types[name].name
        assert tuple(sd[name].shape) == want.shape, name
        assert torch.equal(sd[name], torch.from_numpy(want)), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0], ids=lambda t: t.name)
def test_llama_permutation_undone(tmp_path, qtype):
    """Against the weights before they were written: exact for F32, close for the others (a
    wrong row order would be off by whole rows)."""
    w = write_gguf(tmp_path / "m.gguf", "llama", qtype)
    sd = GGUFCheckpoint.open(w.path).state_dict(progress=False)
    tol = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}[qtype]
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        torch.testing.assert_close(sd[name], torch.from_numpy(w.original[name]), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name
)
def test_dequantization_agrees_with_transformers_torch_kernels(tmp_path, qtype):
    """transformers' own (torch) dequantizers on the same bytes: the K-quant files hold random
    blocks, so this checks they decode as a second implementation reads them."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    w = write_gguf(tmp_path / "m.gguf", "qwen3", qtype)
    t = GGUFCheckpoint.open(w.path).tensors["model.layers.0.mlp.up_proj.weight"]
    ref = hf_dequantize(torch.from_numpy(np.array(t.raw.data)), int(qtype)).reshape(t.shape)
    torch.testing.assert_close(t.load(), ref)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_names_and_no_permutation(tmp_path, family):
    s = Shape(heads=2, kv_heads=1, head_dim=64) if family == "qwen3" else Shape()  # qwen3: head_dim != hidden / heads
    w = write_gguf(tmp_path / "m.gguf", family, Q.F32, s=s, tied=False)
    ck = GGUFCheckpoint.open(w.path)
    sd = ck.state_dict(progress=False)
    assert set(sd) == set(w.original)
    for name, x in w.original.items():
        assert torch.equal(sd[name], torch.from_numpy(x)), name
    cfg = model_config(ck.config)
    assert cfg.architecture == family and cfg.head_dim == 64 and not cfg.tie_word_embeddings
    assert (cfg.num_heads, cfg.num_kv_heads) == (s.heads, s.kv_heads)
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 2048 and cfg.eos_token_ids == (2,)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_K], ids=lambda t: t.name)
def test_row_and_column_slices(tmp_path, qtype):
    """A TP rank's ranges (rows of a column-parallel weight, columns of a row-parallel one) equal
    slices of the whole tensor; row slices of a permuted q read the right file rows."""
    ck = GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", "llama", qtype).path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        t = ck.tensors[name]
        full = t.load()
        assert t.get_shape() == list(full.shape)
        assert torch.equal(t[:], full)
        assert torch.equal(t[64:192], full[64:192])
        assert torch.equal(t[:, 32:96], full[:, 32:96])
    norm = ck.tensors["model.norm.weight"]
    assert torch.equal(norm[10:20], norm.load()[10:20])


def test_dtype_and_progress(tmp_path, capsys):
    ck = GGUFCheckpoint.open(write_gguf(tmp_path / "m.gguf", "llama", Q.Q8_0).path)
    full = ck.state_dict(torch.float32, progress=False)
    half = ck.state_dict(torch.bfloat16, progress=True)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)
    assert "dequantizing GGUF" in capsys.readouterr().err
    ck.state_dict(progress=None)  # auto: no terminal under pytest, so no bar
    assert "dequantizing GGUF" not in capsys.readouterr().err
