"""fp32 linear weights in column panels, multiplied by cpu/kernels/weight_only.cpp's
f32_panel_linear: every fp32 projection of a CPU model, prefill and decode alike.

Why (issue 31, docs/benchmarks.md): oneDNN's packed product, the previous form, read a weight at
one row at ~14 GB/s on the EPYC (a batch-1 decode step of SmolLM2 took 42 ms, llama.cpp F32 25
ms), and its results depend on how its kernel blocks the sum, so a faster GEMV for the decode
step alone would have given the decode other bits than the prefill. The panel kernel is one
kernel for every row count: each output is one chain of fused multiply-adds over K, so a token's
projections give the same bits in a prefill, alone in a decode step or in a decode batch of any
size, on any thread count; a batch-1 step streams the panels sequentially (33 GB/s on huge
pages), and from 8 rows up it is as fast as oneDNN's GEMM or faster (measured at 1, 8, 32 and 512
rows on the model's shapes).

Layout: panels [P, K, PW] fp32, panel p holding output columns [p PW, (p + 1) PW) k-major
(panels[p, k, j] = w[p PW + j, k]), zeros past the last output; PW = 4 vectors of the CPU's
widest float vector (64 columns with AVX-512, 32 with AVX2). It replaces the dense weight (no
second copy); `dense()` gives the [N, K] weight back.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels


def panel_kernels() -> ModuleType | None:
    """The extension with f32_panel_linear, or None (KVPIPE_CPU_KERNELS=0, a failed build,
    KVPIPE_PANEL_WEIGHTS=0): fp32 linears then stay as they were loaded."""
    if os.environ.get("KVPIPE_PANEL_WEIGHTS", "1") == "0":
        return None
    return weight_only_kernels()


def to_panels(t: torch.Tensor, pw: int, fill: float = 0.0) -> torch.Tensor:
    """[N, K] (any dtype) -> [ceil(N / pw), K, pw], the panel layout; rows past N are `fill`."""
    n, k = t.shape
    p = -(-n // pw)
    return F.pad(t, (0, 0, 0, p * pw - n), value=fill).view(p, pw, k).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[P, K, pw] -> the [n, K] rows it holds (to_panels' inverse)."""
    p, k, pw = panels.shape
    return panels.transpose(1, 2).reshape(p * pw, k)[:n]


class PanelWeight(nn.Module):
    """A dense fp32 [N, K] weight as panels [P, K, PW] (the module docstring)."""

    panels: torch.Tensor

    def __init__(self, panels: torch.Tensor, out_features: int, ext: ModuleType) -> None:
        super().__init__()
        pw = int(ext.f32_panel_width())
        if panels.dtype != torch.float32 or panels.dim() != 3 or panels.shape[2] != pw:
            raise ValueError(f"panels must be fp32 [P, K, {pw}], got {tuple(panels.shape)} {panels.dtype}")
        if not (panels.shape[0] - 1) * pw < out_features <= panels.shape[0] * pw:
            raise ValueError(f"{out_features} outputs do not fill {panels.shape[0]} panels of {pw}")
        self.register_buffer("panels", panels.contiguous())
        self.out_features = out_features
        self.ext = ext

    @classmethod
    def pack(cls, w: torch.Tensor, ext: ModuleType) -> PanelWeight:
        """[N, K] dense fp32 -> its panels."""
        return cls(to_panels(w.detach().float(), int(ext.f32_panel_width())), w.shape[0], ext)

    @property
    def in_features(self) -> int:
        return int(self.panels.shape[1])

    def dense(self) -> torch.Tensor:
        """The [N, K] weight."""
        return from_panels(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] fp32."""
        lead = x.shape[:-1]
        y = self.ext.f32_panel_linear(x.reshape(-1, x.shape[-1]), self.panels, self.out_features)
        return y.view(*lead, self.out_features)
