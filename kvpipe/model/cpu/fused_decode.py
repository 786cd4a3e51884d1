"""A decode step's decoder layers as one C++ call each (--decode-fused-layer, issue 31).

Why: at batch 1 a small model's decode step is bound by per-call costs, not by its weights
(docs/benchmarks.md, issue 31): a Llama layer is ~20 Python-level calls (module calls, views,
checks, torch dispatch) around its four GEMMs and the attention kernel, 30 layers a step. Here
each layer is one call into cpu/kernels/decode_layer.cpp, which runs the same ops on the same
inputs from C++: RMSNorm, residual adds, silu and the SwiGLU product as the same ATen ops, the
projections as the same fp32 panel or weight-only kernel (or oneDNN's packed op where the panels
are not built), RoPE + K/V store and the paged attention as the same kernels' code. So the outputs
and the pool are bit-identical to the module path (tests/unit/test_decode_layer.py), in fp32 and
in the quantized modes, and PD vs colocated stays exact. A bf16 model (--dtype bfloat16) takes
it too: its pair panels on bf16_panel.cpp's kernel, every op rounding to bf16 where the module
path does, the RMSNorm statistics in fp32 (tests/unit/test_decode_layer_bf16.py, the same bits).

Which layers take it: DecoderLayer(RMSNorm, GQAttention, RMSNorm, MLP) with fp32 weights on the
CPU (dense, packed, panels or int8 / int4) or bf16 ones (pair panels or dense), q/k/v and gate/up
fused (fused_projections.py), no biases, no q/k norms, no window or sinks, full rotary dims, TP
1; and per step, a decode batch (every row adds one token) with activations and a pool in the
layers' dtype. Anything else (prefill, extend, Qwen3's q/k norms, MoE, TP > 1, GPT-OSS's fp32
norm weights in a bf16 model, an fp8 pool) runs the module path. All layers in a range or none,
of one dtype: a mixed range runs the module path.

Modes (ServerConfig.decode_fused_layer, --decode-fused-layer): "on" (every decode batch the
layers can take), "auto" (decode batches of at most AUTO_MAX_BATCH rows), "off" (the module path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import DECODE_FUSED_LAYER_MODES
from kvpipe.model.cpu.kernels.decode_layer import decode_layer_kernels
from kvpipe.model.cpu.panel_weight import Bf16PanelWeight, PanelWeight
from kvpipe.model.forward_batch import ForwardBatch
from kvpipe.model.layers.decoder_layer import DecoderLayer
from kvpipe.model.layers.gqa_attention import GQAttention
from kvpipe.model.layers.linear import Linear
from kvpipe.model.layers.mlp import MLP
from kvpipe.model.layers.norms import RMSNorm
from kvpipe.model.quant.weights import Int4Weight, Int8Weight

# "auto": the largest decode batch that takes the fused layers. Measured faster than the modules at
# 1, 8 and 32 rows (docs/benchmarks.md, issue 31); beyond 64 unmeasured, and the GEMMs dominate there
AUTO_MAX_BATCH = 64

# decode_layer.cpp's projection kinds
_DENSE, _PACKED, _INT8, _INT4, _PANEL, _INT8_PANEL, _INT4_PANEL, _BF16_PANEL = 0, 1, 2, 3, 4, 5, 6, 7
# the layers' dtypes decode_layer.cpp runs
DTYPES = (torch.float32, torch.bfloat16)

# (kind, weight, scale, minimum, output features of a panel weight)
ProjSpec = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]


class FusedDecodeLayers:
    """The C++ layer objects of a model, by layer index, and the step-level gate."""

    def __init__(self, layers: dict[int, Any], max_batch: int | None, dtype: torch.dtype = torch.float32) -> None:
        self.layers = layers  # layer index -> decode_layer.cpp's DecodeLayer
        self.max_batch = max_batch  # None: any decode batch
        self.dtype = dtype  # the layers' weights, activations and pool: float32 or bfloat16

    def takes(self, batch: ForwardBatch, pool: KVPool, hidden: torch.Tensor, start: int, end: int) -> bool:
        """Whether layers [start, end) of this forward run fused."""
        decode = batch.decode
        if decode is None or hidden.dtype != self.dtype or pool.dtype != self.dtype or pool.latent:
            return False
        if self.max_batch is not None and decode.batch_size > self.max_batch:
            return False
        return all(i in self.layers for i in range(start, end))

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        start: int,
        end: int,
    ) -> torch.Tensor:
        """Layers [start, end) of a decode step: hidden [B, hidden] -> [B, hidden]; writes their K/V."""
        decode = batch.decode
        assert decode is not None
        table, lens, key_start = decode.page_table, decode.lens, decode.key_start
        pages, offsets = batch.slot_pages, batch.slot_offsets
        cos, sin = cos.contiguous(), sin.contiguous()
        for i in range(start, end):
            hidden = self.layers[i].forward(
                hidden,
                cos,
                sin,
                pool.k[i],
                pool.v[i],
                pages,
                offsets,
                table,
                lens,
                key_start,
                pool.k_scale[i],
                pool.v_scale[i],
            )
        return hidden


def build_fused_decode(model: nn.Module, mode: str) -> FusedDecodeLayers | None:
    """The fused layers of a loaded (fused, packed or quantized) model for `mode`; None when the
    mode is off, the kernels are unavailable, or no layer qualifies."""
    if mode not in DECODE_FUSED_LAYER_MODES:
        raise ValueError(f"decode_fused_layer must be one of {DECODE_FUSED_LAYER_MODES}, got {mode!r}")
    if mode == "off":
        return None
    layers = getattr(model, "layers", None)
    cfg = getattr(model, "cfg", None)
    if not isinstance(layers, nn.ModuleList) or cfg is None or cfg.rope_dim != cfg.head_dim:
        return None  # partial rotary: the RoPE + store kernel rotates whole heads
    specs = {i: spec for i, layer in enumerate(layers) if (spec := _layer_spec(layer, i)) is not None}
    dtypes = {t.dtype for spec in specs.values() if isinstance(t := spec["input_norm"], torch.Tensor)}
    if len(dtypes) != 1:
        return None  # no layer qualifies, or layers of two dtypes
    ext = decode_layer_kernels()
    if ext is None:
        return None
    made = {i: ext.DecodeLayer(**spec) for i, spec in specs.items()}
    return FusedDecodeLayers(made, AUTO_MAX_BATCH if mode == "auto" else None, dtypes.pop())


def _layer_spec(layer: nn.Module, index: int) -> dict[str, object] | None:
    """decode_layer.cpp's constructor arguments for a layer that qualifies, else None."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    if type(attn) is not GQAttention or type(mlp) is not MLP or type(n1) is not RMSNorm or type(n2) is not RMSNorm:
        return None
    if attn.layer != index or attn.qkv is None or attn.q_norm is not None or attn.k_norm is not None:
        return None
    if attn.window is not None or attn.sinks is not None or mlp.gate_up is None or mlp.activation != "silu":
        return None
    dtype = n1.weight.dtype  # the layer's: a bf16 model's norm weights are bf16 (not GPT-OSS's fp32 ones)
    if n1.eps != n2.eps or dtype not in DTYPES or not all(_on_cpu(n.weight, dtype) for n in (n1, n2)):
        return None
    projs = [_proj(p, dtype) for p in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)]
    if any(p is None for p in projs):
        return None
    qkv, o, gate_up, down = projs
    return {
        "input_norm": n1.weight.detach(),
        "post_norm": n2.weight.detach(),
        "eps": float(n1.eps),
        "qkv": qkv,
        "o": o,
        "gate_up": gate_up,
        "down": down,
        "q_heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": mlp.inter,
        "scale": float(attn.scale),
    }


def _on_cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype


def _proj(p: Linear, dtype: torch.dtype) -> ProjSpec | None:
    """A projection as decode_layer.cpp holds it in a layer of `dtype`; None for one it cannot run
    (a bias, an all-reduce, a weight of another dtype, a bf16 weight quantized or oneDNN-packed)."""
    if p.bias is not None or p.all_reduce or not _on_cpu(p.weight, dtype):
        return None
    empty = torch.empty(0)
    if dtype == torch.bfloat16:
        if isinstance(p.panel, Bf16PanelWeight):
            return (_BF16_PANEL, p.panel.panels, empty, empty, p.panel.out_features)
        if p.quant is not None or p.panel is not None or p.weight.is_mkldnn or p.weight.numel() == 0:
            return None
        return (_DENSE, p.weight.detach(), empty, empty, 0)
    q = p.quant
    if isinstance(q, Int8Weight):
        kind, n = (_INT8_PANEL, q.out_features) if q.packed else (_INT8, 0)
        return (kind, q.q, q.scale, empty, n)
    if isinstance(q, Int4Weight):
        kind, n = (_INT4_PANEL, q.out_features) if q.packed else (_INT4, 0)
        return (kind, q.codes, q.scale, q.minimum, n)
    if isinstance(p.panel, PanelWeight):
        return (_PANEL, p.panel.panels, empty, empty, p.panel.out_features)
    if q is not None or p.weight.numel() == 0:
        return None
    return (_PACKED if p.weight.is_mkldnn else _DENSE, p.weight.detach(), empty, empty, 0)
