"""Python face of bf16_panel.cpp: bf16 linears over weights in column panels of K pairs."""

from __future__ import annotations

from types import ModuleType

from kvpipe.model.cpu.kernels.loader import kernels_enabled, load_extra


def bf16_panel_kernels() -> ModuleType | None:
    """The built extension (`bf16_panel_linear(x, panels, n)`, `bf16_panel_width()`,
    `bf16_panel_native()`), built on first use; None when KVPIPE_CPU_KERNELS=0 or the build failed
    (bf16 linears then stay dense, on torch's F.linear)."""
    if not kernels_enabled():
        return None
    return load_extra("bf16_panel")
