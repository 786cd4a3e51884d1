"""Linear weights pre-packed into oneDNN's blocked layout (CPU, fp32).

Why: `F.linear` hands MKL a row-major [out, in] weight and MKL re-blocks it for its kernel on
every call. A decode step is a handful of rows against every weight of the model, so that
per-call packing is a large share of the step: measured on the 2-core EPYC of this project's
benchmarks (2 threads, the `bench` preset's 84 projections), 76 -> 53 ms at 32 rows and
48 -> 31 ms at 8 rows, and no loss at 256-2,048 rows. Packing once at load time is what
IPEX and SGLang's CPU backend (`weight_packed_linear`) do.

The packed weight replaces the dense one (no second copy of the model): it is an opaque
mkldnn tensor with the same shape and dtype; read it with `.to_dense()`. oneDNN's result does
not depend on how many rows share the call (a row gives the same bits alone or in a batch),
and differs from MKL's sgemm in the order of its sums (|diff| ~1e-6 relative).

`KVPIPE_PACK_WEIGHTS=0` keeps the dense weights (for A/B benchmarks).
"""

from __future__ import annotations

import os

import torch

# rows oneDNN tunes the packed layout for; any row count works with it, and the choice made no
# measurable difference from 1 to 2,048 rows on this project's CPU
PACK_ROWS_HINT = 64


def packing_enabled() -> bool:
    return os.environ.get("KVPIPE_PACK_WEIGHTS", "1") != "0" and torch.backends.mkldnn.is_available()


def can_pack(weight: torch.Tensor) -> bool:
    """A dense fp32 [out, in] weight on the CPU (oneDNN's fp32 path is the one measured; bf16 on
    CPUs without AVX-512 BF16 would be emulated)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
        and weight.numel() > 0
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> the same weight in oneDNN's blocked layout (an mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed weight^T (+ bias) -> [..., out], as F.linear."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
