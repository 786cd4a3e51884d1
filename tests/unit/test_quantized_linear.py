"""Weight-only quantized linears (--quantization; kvpipe/model/quant/weights.py,
quantization.py, cpu/kernels/weight_only.cpp): the int8/int4 kernels (fp32 activations) against
the exact product of the input with the dequantized weights (tolerance.matmul_bound), a row
alone against the same row in a batch (bit for bit), the fallback without the kernels, the
quantizers' rounding, GGUF Q4_0/Q4_1 blocks loaded straight (whole and TP-sharded), the
loader's swap and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpipe.config import ConfigError, ServerConfig
from kvpipe.model.checkpoint.gguf.checkpoint import GGUFCheckpoint
from kvpipe.model.checkpoint.loader import check_checkpoint, load_model
from kvpipe.model.cpu.kernels import loader
from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels
from kvpipe.model.layers.linear import Linear, Shard
from kvpipe.model.presets import write_preset
from kvpipe.model.quant.quantize import gguf_codes
from kvpipe.model.quant.weights import GROUP, Int4Weight, Int8Weight
from tests.helpers.gguf_files import Q, write_gguf
from tests.helpers.tolerance import matmul_bound

HALF_ULP = torch.finfo(torch.float32).eps / 2


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact product of the input with the weights."""
    return x.double() @ w.double().T


def _bound(x: torch.Tensor, w_magnitude: torch.Tensor) -> torch.Tensor:
    return matmul_bound(x, w_magnitude)


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, bound there {float(bound.min()):.3g}"


def _panels(weight: Int8Weight | Int4Weight) -> Int8Weight | Int4Weight:
    """The same weight with its codes in column panels (Linear.pack's form)."""
    ext = weight_only_kernels()
    assert ext is not None
    packed = type(weight)(*weight.rows())
    packed.pack(int(ext.f32_panel_width()))
    assert packed.packed and all(torch.equal(a, b) for a, b in zip(packed.rows(), weight.rows()))
    assert torch.equal(packed.dequantize(), weight.dequantize())
    return packed


@pytest.mark.parametrize("rows, n, k", [(1, 48, 64), (7, 96, 160), (33, 16, 32), (6, 130, 40)])
def test_int8_matches_its_dequantized_weight(rows, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.3
    w[3] = 0.0  # a zero row: scale 1, codes 0
    q = Int8Weight.quantize(w)
    deq = q.dequantize()
    # each weight within half a step of its row's fp32 scale (absmax / 127), plus the scale's and
    # the product's fp32 roundings
    step = w.abs().amax(dim=1).clamp(min=1e-30) / 127
    slack = step / 2 + 2 * 127 * step * HALF_ULP
    assert bool(((w - deq).abs() <= slack[:, None] * (1 + 1e-6)).all())
    assert int(q.q.abs().max()) == 127 and bool((deq[3] == 0).all())
    x = torch.randn(rows, k, generator=g)
    _assert_within(q(x), _exact(x, deq), _bound(x, deq))
    _assert_within(_panels(q)(x), _exact(x, deq), _bound(x, deq))  # N = 130: a partial last panel


def _int4_reference(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights q * scale + minimum, exactly; and the size of what the kernel forms for each
    (the two terms may cancel)."""
    s = scale.float().double().repeat_interleave(GROUP, dim=1)
    m = minimum.float().double().repeat_interleave(GROUP, dim=1)
    return q.double() * s + m, (q.double() * s).abs() + m.abs()


@pytest.mark.parametrize("rows, n, k", [(1, 16, 32), (5, 24, 96), (40, 32, 256), (6, 130, 64)])
def test_int4_matches_its_codes(rows, n, k):
    g = torch.Generator().manual_seed(rows + n)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.1 + 1e-3
    minimum = -torch.rand(n, k // GROUP, generator=g)
    w, mag = _int4_reference(q, scale, minimum)
    x = torch.randn(rows, k, generator=g)
    q4 = Int4Weight.from_codes(q, scale, minimum)
    assert torch.equal(q4.unpacked(), q)
    _assert_within(q4(x), _exact(x, w), _bound(x, mag))
    _assert_within(_panels(q4)(x), _exact(x, w), _bound(x, mag))  # N = 130: a partial last panel


def test_int4_quantizer_rounds_to_the_nearest_step():
    """min/max groups of 32 (as Q4_1): every weight within half a step of its group, plus the
    fp32 roundings of the scale (over 15 steps) and of the dequantized weight."""
    g = torch.Generator().manual_seed(3)
    n, k = 32, 128
    w = torch.randn(n, k, generator=g)
    deq = Int4Weight.quantize(w).dequantize()  # [N, K]
    groups = w.reshape(n, k // GROUP, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    big = groups.abs().amax(-1) + 15 * step  # the largest |minimum| and |weight| of the group
    err = (w - deq).reshape(n, k // GROUP, GROUP).abs()
    assert bool((err <= (step / 2 + 15 * step * HALF_ULP + 3 * big * HALF_ULP)[..., None]).all())


def test_int4_refuses_shapes_the_kernel_cannot_take():
    assert Int4Weight.fits(16, 32) and Int4Weight.fits(24, 32) and not Int4Weight.fits(16, 48)
    with pytest.raises(ValueError, match="K % 32"):
        Int4Weight.from_codes(torch.zeros(24, 48, dtype=torch.int32), torch.ones(24, 1), torch.zeros(24, 1))


@pytest.mark.parametrize("kind", ["int8", "int8-panels", "int4", "int4-panels"])
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(kind):
    """Each output's sum runs in an order that depends on K only (weight_only.cpp): a decode row
    alone, or batched with others (odd and even batch sizes), or in a prefill, gives the same bits."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(80, 576, generator=g) * 0.05
    weight = Int4Weight.quantize(w) if kind.startswith("int4") else Int8Weight.quantize(w)
    if kind.endswith("panels"):
        weight = _panels(weight)
    x = torch.randn(9, 576, generator=g)
    batched = weight(x)
    for i in range(9):
        assert torch.equal(weight(x[i : i + 1]), batched[i : i + 1]), i
    assert torch.equal(weight(x[3:8]), batched[3:8])


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_without_the_kernels_the_dequantized_weights_multiply(kind, monkeypatch):
    assert weight_only_kernels() is not None
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 96, generator=g)
    weight = Int8Weight.quantize(w) if kind == "int8" else Int4Weight.quantize(w)
    x = torch.randn(3, 96, generator=g)
    fast = weight(x)
    monkeypatch.setenv(loader.DISABLE_ENV, "0")
    assert weight_only_kernels() is None
    deq = weight.dequantize()
    bound = 2 * _bound(x, deq.abs() + (0 if kind == "int8" else weight.minimum.abs().repeat_interleave(GROUP, 1)))
    _assert_within(fast, _exact(x, deq), bound)
    _assert_within(weight(x), _exact(x, deq), bound)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_gguf_blocks_load_straight_whole_and_sharded(tmp_path, qtype):
    """A Q4_0/Q4_1 tensor's codes, scales and minimums as the int4 kernel's weights give the
    file's dequantized values (gguf-py's), for the whole tensor, a column-parallel row shard (the
    llama q rows, permuted in the file) and a row-parallel shard of whole blocks; a shard cutting
    a block is refused (None: the loader quantizes its values instead)."""
    written = write_gguf(tmp_path / "m.gguf", "llama", qtype)
    tensors = GGUFCheckpoint.open(written.path).tensors
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        src, full = tensors[name], torch.from_numpy(written.expected[name])
        n, k = full.shape
        shards = [
            (None, (slice(None), slice(None))),
            (Shard(0, n // 4, n // 2), (slice(n // 4, 3 * n // 4), slice(None))),
            (Shard(1, k // 2, k // 2), (slice(None), slice(k // 2, k))),
        ]
        for shard, where in shards:
            codes = gguf_codes(src, shard)
            assert codes is not None
            want = full[where]
            q, s, m = codes
            exact = q.double() * s.double().repeat_interleave(GROUP, 1) + m.double().repeat_interleave(GROUP, 1)
            torch.testing.assert_close(exact, want.double(), atol=4 * torch.finfo(torch.float32).eps, rtol=0)
            got, mag = _int4_reference(*codes)
            x = torch.randn(3, want.shape[1], generator=torch.Generator().manual_seed(0))
            _assert_within(Int4Weight.from_codes(*codes)(x), _exact(x, got), _bound(x, mag))
        assert gguf_codes(src, Shard(1, 16, k - 16)) is None


def test_linear_with_a_quantized_weight_adds_its_bias_and_keeps_leading_dims():
    lin = Linear(64, 32, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64))
        lin.bias.copy_(torch.randn(32))
    qw = Int8Weight.quantize(lin.weight)
    lin.quantize(qw)
    assert lin.quant is qw and lin.weight.numel() == 0
    x = torch.randn(2, 3, 64)
    want = _exact(x.reshape(6, 64), qw.dequantize()) + lin.bias.double()
    bound = _bound(x.reshape(6, 64), qw.dequantize()) + torch.finfo(torch.float32).eps * want.abs()
    for _ in ("rows", "panels"):
        y = lin(x)
        assert y.shape == (2, 3, 32)
        _assert_within(y.reshape(6, 32), want, bound)
        assert lin.pack() and qw.packed  # its codes go into panels


def _qkv(layer: torch.nn.Module) -> tuple[Linear, Linear, Linear]:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj


@pytest.mark.parametrize("mode", ["w8a16", "w4a16"])
def test_loader_quantizes_every_projection(tiny_model_dir, mode):
    """Every decoder Linear and the untied lm_head hold a quantized weight; under w4a16 the tiny
    preset's lm_head (vocab 290, not a multiple of 16) falls back to int8."""
    model = load_model(tiny_model_dir, quantization=mode)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() == 0 for m in linears)
    # q/k/v and gate/up were fused after quantizing (fused_projections.py): their parts hold nothing
    fused = {id(p) for layer in model.layers for p in (*_qkv(layer), layer.mlp.gate_proj, layer.mlp.up_proj)}
    assert all((m.quant is None) == (id(m) in fused) for m in linears)
    kinds = {type(m.quant) for m in model.layers.modules() if isinstance(m, Linear) and m.quant is not None}
    assert kinds == ({Int8Weight} if mode == "w8a16" else {Int4Weight})
    assert model.lm_head is not None and isinstance(model.lm_head.quant, Int8Weight)


def test_tied_gguf_head_gets_an_int8_copy(tmp_path):
    written = write_gguf(tmp_path / "m.gguf", "llama", Q.Q4_1)
    model = load_model(written.path, quantization="w4a16")
    assert model.lm_head is None and isinstance(model.head_quant, Int8Weight)
    assert model.embed_tokens.shape == model.head_quant.rows()[0].shape  # the lookup keeps the dense table
    qkv = model.layers[0].self_attn.qkv  # q/k/v fused (fused_projections.py)
    assert qkv is not None and isinstance(qkv.quant, Int4Weight)


@pytest.mark.parametrize(
    "preset, kind",
    [("tiny-qwen3-moe", "sparse MoE"), ("tiny-deepseek-v3", "MoE"), ("tiny-qwen3.5", "hybrid linear-attention")],
)
def test_unsupported_models_are_refused_with_the_reason(tmp_path, preset, kind):
    path = write_preset(preset, tmp_path / preset)
    with pytest.raises(ConfigError, match=f"supports dense attention models.*{kind}"):
        check_checkpoint(path, quantization="w8a16")


def test_unknown_mode_and_other_devices_are_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ServerConfig(model_path=str(tiny_model_dir), quantization="int3")
    with pytest.raises(ConfigError, match="--device cpu"):
        load_model(tiny_model_dir, device="meta", quantization="w8a16")


def test_raw_rows_follow_the_hf_row_order(tmp_path):
    """raw_rows gives the file's bytes in HF row order (the llama q rows are permuted in the file)."""
    written = write_gguf(tmp_path / "m.gguf", "llama", Q.Q8_0)
    src = GGUFCheckpoint.open(written.path).tensors["model.layers.0.self_attn.q_proj.weight"]
    assert src.row_order is not None
    assert np.array_equal(src.raw_rows(slice(2, 5)), src.raw.data[src.row_order[2:5]])
