"""Weight-only quantized linear weights on the CPU (--quantization w8a16 / w4a16).

Only the weights are stored in fewer bits; the C++ kernels (cpu/kernels/weight_only.cpp)
dequantize them as they read them and compute in fp32 with the activations as they come (fp32;
a bf16 model's are widened), so the activations are not rounded at all: the "a16" of the names
(SGLang's) is an upper bound here. Why not torch's `_weight_int8pack_mm` /
`_weight_int4pack_mm_for_cpu`: they vectorize only bf16 inputs and, even so, ran a [1536, 576]
weight at one row in 0.6-1 ms on the 2-core Xeon of docs/benchmarks.md (1-1.5 GMAC/s, compute
bound on unpacking), where a decode step wants memory bandwidth; the kernels here read the packed
bytes at bandwidth (issue 31's table in docs/benchmarks.md). Without the kernels (KVPIPE_CPU_KERNELS=0,
no compiler) a call multiplies with the dequantized weight (slow, same values).
- `Int8Weight`: int8 [N, K], one fp32 scale per output row (symmetric, absmax / 127):
  w[n, k] = q[n, k] * scale[n].
- `Int4Weight`: 4-bit codes in groups of GROUP input columns with a scale and a minimum per
  (row, group): w[n, k] = q[n, k] * scale[n, g] + minimum[n, g], q in 0..15, stored two codes a
  byte in GGUF's block layout (byte j of a group: code j low, code j + 16 high). GGUF's Q4_1 block
  (32 weights, w = d * q + m) is exactly such a group: scale = d, minimum = m; Q4_0
  (w = d * (q - 8)) is scale = d, minimum = -8 d.

Both are modules holding buffers (they move with the model), called as `weight(x)` for
x [..., K] -> [..., N] in x's dtype. Each output is computed in an order that depends on K only,
so a row gives the same bits alone or in any batch (PD and colocated servers agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels
from kvpipe.model.cpu.panel_weight import from_panels, to_panels

GROUP = 32  # int4 group size along K: GGUF's Q4_0/Q4_1 block, and llama.cpp's choice


class Int8Weight(nn.Module):
    """w ≈ q * scale[:, None]: q int8 [N, K], scale [N] fp32. Once loaded, `pack` lays the codes
    out as column panels (panel_weight.py's layout, int8: one 64-byte line per k of a panel with
    AVX-512) for weight_only.cpp's int8_panel_linear: a decode step streams them sequentially and
    a prefill tile is bound by its FMAs (1.3-2.2x the row kernel on the EPYC, docs/benchmarks.md);
    each output stays one order of sums whatever the row count."""

    q: torch.Tensor  # int8 [N, K]; packed: [P, K, PW]
    scale: torch.Tensor  # [N]; packed: [P PW] (1 past N)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"int8 weight [N, K] with N scales, got {tuple(q.shape)} {q.dtype}, {tuple(scale.shape)}")
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.n = int(q.shape[0])
        self.packed = False

    def pack(self, pw: int) -> None:
        """Lay the codes out in panels of `pw` columns (the kernel's f32_panel_width())."""
        if self.packed:
            return
        self.q = to_panels(self.q, pw)
        self.scale = F.pad(self.scale, (0, self.q.shape[0] * pw - self.n), value=1.0)
        self.packed = True

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes [N, K] and scales [N], packed or not."""
        if not self.packed:
            return self.q, self.scale
        return from_panels(self.q, self.n), self.scale[: self.n]

    @classmethod
    def quantize(cls, w: torch.Tensor, amax: torch.Tensor | None = None) -> Int8Weight:
        """Symmetric per-row int8 of a dense [N, K] weight; a zero row gets scale 1 (q = 0).
        `amax` [N]: each row's largest |weight| over the whole checkpoint row, when `w` holds only
        some of its columns (a row-parallel TP shard), so every TP size quantizes alike."""
        w = w.detach().float()
        amax = w.abs().amax(dim=1) if amax is None else amax.float()
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    @property
    def out_features(self) -> int:
        return self.n

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] in fp32 (int8 times the scale, rounded once)."""
        q, scale = self.rows()
        return q.float() * scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        ext = weight_only_kernels() if x.device.type == "cpu" else None
        if ext is None:
            y = F.linear(x2.float(), self.dequantize())
        elif self.packed:
            y = ext.int8_panel_linear(x2, self.q, self.scale, self.n)
        else:
            y = ext.int8_linear(x2, self.q, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4Weight(nn.Module):
    """Groupwise 4-bit weight [N, K], two codes a byte (see the module docstring)."""

    # packed (`pack`, once loaded): column panels for int4_panel_linear, codes [P, K, PW / 2] (byte j
    # of a panel row: column j low, column j + PW / 2 high), scale and minimum [P, K / GROUP, PW]
    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        """codes uint8 [N, K / 2] (GGUF block layout), scale and minimum [N, K / GROUP]."""
        super().__init__()
        n, half = codes.shape
        if codes.dtype != torch.uint8 or scale.shape != (n, 2 * half // GROUP) or minimum.shape != scale.shape:
            raise ValueError(f"int4 codes [N, K / 2] uint8 with [N, K / {GROUP}] scales, got {tuple(codes.shape)}")
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("minimum", minimum.float().contiguous())
        self.n, self.k = n, 2 * half
        self.packed = False

    def pack(self, pw: int) -> None:
        """Lay the weight out in panels of `pw` columns (the kernel's f32_panel_width()): a decode
        step streams them sequentially, a prefill tile is bound by its FMAs."""
        if self.packed:
            return
        q = to_panels(self.unpacked().to(torch.uint8), pw)  # [P, K, PW]
        self.codes = (q[..., : pw // 2] | (q[..., pw // 2 :] << 4)).contiguous()  # [P, K, PW / 2]
        self.scale, self.minimum = to_panels(self.scale, pw, 1.0), to_panels(self.minimum, pw)
        self.packed = True

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes [N, K / 2] in GGUF block layout, scale and minimum [N, K / GROUP], packed or not."""
        if not self.packed:
            return self.codes, self.scale, self.minimum
        q = from_panels(torch.cat([self.codes & 0x0F, self.codes >> 4], dim=2), self.n)  # [N, K]
        g = q.reshape(self.n, self.k // GROUP, 2, GROUP // 2)
        codes = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(self.n, self.k // 2)
        scale, minimum = from_panels(self.scale, self.n), from_panels(self.minimum, self.n)
        return codes, scale, minimum

    @property
    def out_features(self) -> int:
        return self.n

    @property
    def in_features(self) -> int:
        return self.k

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether a weight of this shape splits into whole groups."""
        return in_features % GROUP == 0 and in_features > 0 and out_features > 0

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Int4Weight:
        """From codes q [N, K] in 0..15 with w = q * scale + minimum per group: scale and minimum
        [N, K / GROUP] (GGUF Q4_1's d and m; Q4_0 is minimum = -8 d)."""
        n, k = q.shape
        if not cls.fits(n, k) or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
            raise ValueError(f"int4 weight [{n}, {k}] needs K % {GROUP} == 0 and [N, K / {GROUP}] scales")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("int4 codes must lie in 0..15")
        g = q.to(torch.uint8).reshape(n, k // GROUP, 2, GROUP // 2)  # [N, groups, low/high, 16]
        codes = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)
        return cls(codes, scale, minimum)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max 4-bit groups of a dense [N, K] weight (what GGUF's Q4_1 does)."""
        n, k = w.shape
        g = w.detach().float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
        return cls.from_codes(q, scale, lo)

    def unpacked(self) -> torch.Tensor:
        """The codes [N, K] int64 in 0..15."""
        codes = self.rows()[0]
        n, half = codes.shape
        c = codes.reshape(n, half // (GROUP // 2), 1, GROUP // 2).long()
        return torch.cat([c & 0x0F, c >> 4], dim=2).reshape(n, 2 * half)

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 as the kernel forms them: q * scale + minimum, rounded once (fp64 then fp32)."""
        _, scale, minimum = self.rows()
        s = scale.double().repeat_interleave(GROUP, dim=1)
        m = minimum.double().repeat_interleave(GROUP, dim=1)
        return (self.unpacked().double() * s + m).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        ext = weight_only_kernels() if x.device.type == "cpu" else None
        if ext is None:
            y = F.linear(x2.float(), self.dequantize())
        elif self.packed:
            y = ext.int4_panel_linear(x2, self.codes, self.scale, self.minimum, self.n)
        else:
            y = ext.int4_linear(x2, self.codes, self.scale, self.minimum)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


QuantizedWeight = Int8Weight | Int4Weight
