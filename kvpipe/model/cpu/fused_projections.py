"""Projections that read the same input fused into one call, once the weights are loaded: an
attention layer's q/k/v into `qkv`, a SwiGLU MLP's gate/up into `gate_up`.

Why: at batch 1 a decode step of a small model is bound by per-call cost, not by the bytes of
its weights (docs/benchmarks.md, issue 31): every projection is a oneDNN or int8/int4 kernel call
with its dispatch and, in the quantized modes, a bf16 conversion of its input and an fp32 one of
its output. One call over the concatenated output rows reads the same bytes with fewer calls:
7 -> 4 per Llama layer.

Exact: each output column of a fused product is computed as it was alone. oneDNN's packed fp32
product does not depend on how many output columns share the call (tests/unit/
test_fused_projections.py checks bit equality), and the weight-only kernels compute every
output column from its own weight row alone (cpu/kernels/weight_only.cpp). Parts that cannot
share a call (different weight kinds, a bias on some only, row-parallel parts that all-reduce)
stay apart.

The module tree keeps q_proj/k_proj/v_proj and gate_proj/up_proj (the loader's names); after
fusing, each part holds an empty [0, in] weight, as a quantized Linear does. Only on the CPU,
where the bit equality was checked. `KVPIPE_FUSE_PROJECTIONS=0` keeps them apart (A/B benchmarks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from kvpipe.model.layers.linear import Linear
from kvpipe.model.quant.weights import Int4Weight, Int8Weight, QuantizedWeight


def fusing_enabled() -> bool:
    return os.environ.get("KVPIPE_FUSE_PROJECTIONS", "1") != "0"


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every module that can (a `fuse_projections()` method: GQAttention's
    q/k/v, MLP's gate/up); returns how many fused."""
    # listed first: fusing adds submodules
    owners = [cast(_Fuses, m) for m in model.modules() if callable(getattr(type(m), "fuse_projections", None))]
    return sum(m.fuse_projections() for m in owners)


class _Fuses(Protocol):
    def fuse_projections(self) -> bool: ...


def fuse_linears(parts: Sequence[Linear]) -> Linear | None:
    """One Linear computing torch.cat([p(x) for p in parts], -1), taking the parts' weights (each
    part is left with an empty weight); None, the parts untouched, when they cannot share a call.
    Call it after quantizing and before packing (loader.load_model)."""
    if len(parts) < 2 or not _compatible(parts):
        return None
    first = parts[0]
    out = sum(_out_features(p) for p in parts)
    fused = Linear(first.weight.shape[1], out, bias=False, packable=first.packable)
    with torch.no_grad():
        if first.quant is None:
            fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        else:
            fused.quantize(_cat_quant([p.quant for p in parts if p.quant is not None]))
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts if p.bias is not None]), requires_grad=False)
    for p in parts:
        p.weight = nn.Parameter(p.weight.new_empty(0, p.weight.shape[1]), requires_grad=False)
        p.quant = None
    return fused


def _out_features(p: Linear) -> int:
    return p.quant.out_features if p.quant is not None else int(p.weight.shape[0])


def _compatible(parts: Sequence[Linear]) -> bool:
    first = parts[0]
    if any(p.all_reduce or p.weight.is_mkldnn or p.panel is not None or p.packable != first.packable for p in parts):
        return False
    if any((p.bias is None) != (first.bias is None) for p in parts):
        return False
    if any(p.weight.shape[1] != first.weight.shape[1] or p.weight.dtype != first.weight.dtype for p in parts):
        return False
    if any(p.weight.device != first.weight.device for p in parts):
        return False
    if first.quant is None:
        return all(p.quant is None and p.weight.numel() > 0 for p in parts)
    kind = type(first.quant)
    return all(type(p.quant) is kind for p in parts)


def _cat_quant(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Quantized weights of the same kind stacked along their output rows."""
    int8 = [p for p in parts if isinstance(p, Int8Weight)]
    if len(int8) == len(parts):
        rows = [p.rows() for p in int8]
        return Int8Weight(torch.cat([q for q, _ in rows]), torch.cat([scale for _, scale in rows]))
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if len(int4) != len(parts):
        raise ValueError("only quantized weights of one kind concatenate")
    parts4 = [p.rows() for p in int4]
    return Int4Weight(*(torch.cat([part[i] for part in parts4]) for i in range(3)))
