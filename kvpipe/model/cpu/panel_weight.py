"""fp32 linear weights in column panels, multiplied by cpu/kernels/weight_only.cpp's
f32_panel_linear: every fp32 projection of a CPU model, prefill and decode alike; bf16 ones in
panels of K pairs, multiplied by cpu/kernels/bf16_panel.cpp (Bf16PanelWeight, at the end).

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

from kvpipe.model.cpu.kernels.bf16_panel import bf16_panel_kernels
from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels


def panel_kernels() -> ModuleType | None:
    """The extension with f32_panel_linear, or None (KVPIPE_CPU_KERNELS=0, a failed build,
    KVPIPE_PANEL_WEIGHTS=0): fp32 linears then stay as they were loaded."""
    if os.environ.get("KVPIPE_PANEL_WEIGHTS", "1") == "0":
        return None
    return weight_only_kernels()


def bf16_panels(w: torch.Tensor) -> Bf16PanelWeight | None:
    """A dense bf16 [N, K] CPU weight as pair panels (Bf16PanelWeight), or None: another dtype or
    device, an empty or packed weight, or no kernel (KVPIPE_PANEL_WEIGHTS=0, KVPIPE_CPU_KERNELS=0,
    a failed build); the weight then stays dense, on torch's F.linear."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 or w.is_mkldnn or w.numel() == 0:
        return None
    if os.environ.get("KVPIPE_PANEL_WEIGHTS", "1") == "0":
        return None
    ext = bf16_panel_kernels()
    return None if ext is None else Bf16PanelWeight.pack(w, ext)


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


def to_pair_panels(t: torch.Tensor, pw: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / pw), ceil(K / 2), 2 pw], bf16_panel.cpp's layout: panel p, pair h holds
    w[p pw + j, 2 h + t] at 2 j + t; zeros past N and past K."""
    n, k = t.shape
    p, kh = -(-n // pw), -(-k // 2)
    padded = F.pad(t, (0, 2 * kh - k, 0, p * pw - n))
    return padded.view(p, pw, kh, 2).transpose(1, 2).reshape(p, kh, 2 * pw).contiguous()


def from_pair_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[P, Kh, 2 pw] -> the [n, k] weight it holds (to_pair_panels' inverse)."""
    p, kh, two_pw = panels.shape
    pw = two_pw // 2
    return panels.view(p, kh, pw, 2).transpose(1, 2).reshape(p * pw, 2 * kh)[:n, :k]


class Bf16PanelWeight(nn.Module):
    """A dense bf16 [N, K] weight as pair panels (cpu/kernels/bf16_panel.cpp): y = x w^T summed in
    fp32, rounded to bf16, one kernel for every row count (a token's projection has the same bits in
    a prefill and in a decode step of any batch size)."""

    panels: torch.Tensor

    def __init__(self, panels: torch.Tensor, out_features: int, in_features: int, ext: ModuleType) -> None:
        super().__init__()
        pw = int(ext.bf16_panel_width())
        if panels.dtype != torch.bfloat16 or panels.dim() != 3 or panels.shape[2] != 2 * pw:
            raise ValueError(f"panels must be bf16 [P, Kh, {2 * pw}], got {tuple(panels.shape)} {panels.dtype}")
        if not (panels.shape[0] - 1) * pw < out_features <= panels.shape[0] * pw:
            raise ValueError(f"{out_features} outputs do not fill {panels.shape[0]} panels of {pw}")
        if -(-in_features // 2) != panels.shape[1]:
            raise ValueError(f"{in_features} inputs do not fill {panels.shape[1]} pairs")
        self.register_buffer("panels", panels.contiguous())
        self.out_features = out_features
        self.in_features = in_features
        self.ext = ext

    @classmethod
    def pack(cls, w: torch.Tensor, ext: ModuleType) -> Bf16PanelWeight:
        """[N, K] dense bf16 -> its pair panels."""
        return cls(to_pair_panels(w.detach(), int(ext.bf16_panel_width())), w.shape[0], w.shape[1], ext)

    def dense(self) -> torch.Tensor:
        """The [N, K] weight."""
        return from_pair_panels(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] bf16."""
        lead = x.shape[:-1]
        y = self.ext.bf16_panel_linear(x.reshape(-1, x.shape[-1]), self.panels, self.out_features)
        return y.view(*lead, self.out_features)
