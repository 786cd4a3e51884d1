"""Python face of decode_layer.cpp: a Llama-style decoder layer's decode step in one C++ call."""

from __future__ import annotations

from types import ModuleType

from kvpipe.model.cpu.kernels.loader import kernels_enabled, load_extra


def decode_layer_kernels() -> ModuleType | None:
    """The built extension (`DecodeLayer(...)`, `.forward(...)`; model/cpu/fused_decode.py builds and
    calls them), built on first use; None when KVPIPE_CPU_KERNELS=0 or the build failed."""
    if not kernels_enabled():
        return None
    return load_extra("decode_layer")
