"""Python face of weight_only.cpp: int8 / int4 weight-only linears computed in fp32."""

from __future__ import annotations

from types import ModuleType

from kvpipe.model.cpu.kernels.loader import kernels_enabled, load_extra


def weight_only_kernels() -> ModuleType | None:
    """The built extension (`int8_linear(x, q, scale)`, `int4_linear(x, codes, scale, minimum)`,
    quantized_weight.py has the formats), built on first use; None when KVPIPE_CPU_KERNELS=0 or the
    build failed (callers then multiply with the dequantized weights)."""
    if not kernels_enabled():
        return None
    return load_extra("weight_only")
