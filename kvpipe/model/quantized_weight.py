"""Weight-only quantized linear weights on the CPU (--quantization w8a16 / w4a16).

Only the weights are stored in fewer bits; the kernels take the activations in bf16 (the "a16":
a linear's input is rounded to bf16 on the way in, its output returns in the model dtype) and the
scales in bf16 too. Why bf16: torch 2.13's CPU kernels vectorize (AVX-512) only that path; with
fp32 inputs they run a scalar loop, measured on the 2-core Xeon of docs/benchmarks.md at 1 thread
for a [1536, 576] weight: int8 11.2 ms per row against 0.97 ms with bf16 (fp32 oneDNN-packed:
1.2 ms). At one row the quantized kernels are then 2-3x faster than the packed fp32 GEMM (they
read a quarter or an eighth of the bytes); at 16 rows and more they are about 2x slower than it,
so prefill pays for what decode gains.
- `Int8Weight`: int8 [N, K], one scale per output row (symmetric, absmax / 127):
  w[n, k] = q[n, k] * scale[n]; `aten._weight_int8pack_mm(x [M, K], q [N, K] int8, scale [N])`.
- `Int4Weight`: 4-bit codes in groups of GROUP input columns with a scale and a zero per
  (group, row): w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], q in 0..15;
  `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], inner_k_tiles)` packs the codes
  once and `aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros [K / GROUP, N, 2])`
  multiplies. GGUF's Q4_1 block (32 weights, w = d * q + m) is exactly such a group: scale = d,
  zero = m + 8 d; Q4_0 (w = d * (q - 8)) is scale = d, zero = 0. The kernel needs N % 16 == 0.

Both are modules holding buffers (they move with the model), called as `weight(x)` for
x [..., K] -> [..., N] in x's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # int4 group size along K: GGUF's Q4_0/Q4_1 block, and llama.cpp's choice
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
INNER_K_TILES = 2  # the CPU pack ignores it beyond validation; 2 is what torchao passes
ACT_DTYPE = torch.bfloat16  # what the kernels compute with (see above); scales are stored in it


class Int8Weight(nn.Module):
    """w ≈ q * scale[:, None]: q int8 [N, K], scale [N] in ACT_DTYPE."""

    q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"int8 weight [N, K] with N scales, got {tuple(q.shape)} {q.dtype}, {tuple(scale.shape)}")
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.contiguous())

    @classmethod
    def quantize(cls, w: torch.Tensor, amax: torch.Tensor | None = None) -> Int8Weight:
        """Symmetric per-row int8 of a dense [N, K] weight; a zero row gets scale 1 (q = 0).
        `amax` [N]: each row's largest |weight| over the whole checkpoint row, when `w` holds only
        some of its columns (a row-parallel TP shard), so every TP size quantizes alike."""
        w = w.detach().float()
        amax = w.abs().amax(dim=1) if amax is None else amax.float()
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale.to(ACT_DTYPE))

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """[N, K] in fp32 (exact: int8 times a bf16 scale)."""
        return self.q.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4Weight(nn.Module):
    """Groupwise 4-bit weight [N, K] packed for torch's CPU kernel (see the module docstring)."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int, in_features: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros.contiguous())  # [K / GROUP, N, 2]
        self.out_features = out_features
        self.in_features = in_features

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the kernel takes a weight of this shape."""
        return out_features % INT4_N_MULTIPLE == 0 and in_features % GROUP == 0 and in_features > 0

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> Int4Weight:
        """From codes q [N, K] in 0..15 with w = q * scale + minimum per group: scale and minimum
        [N, K / GROUP] (GGUF Q4_1's d and m; Q4_0 is minimum = -8 d)."""
        n, k = q.shape
        if not cls.fits(n, k) or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
            raise ValueError(f"int4 weight [{n}, {k}] needs N % {INT4_N_MULTIPLE} == 0, K % {GROUP} == 0")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("int4 codes must lie in 0..15")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
        scale = scale.float()
        zero = minimum.float() + 8.0 * scale  # (q - 8) * scale + zero == q * scale + minimum
        scale_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(ACT_DTYPE)  # [K / GROUP, N, 2]
        return cls(packed, scale_zeros, n, k)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max 4-bit groups of a dense [N, K] weight (what GGUF's Q4_1 does)."""
        n, k = w.shape
        g = w.detach().float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(n, k)
        return cls.from_codes(q, scale, lo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(ACT_DTYPE).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scale_zeros)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


QuantizedWeight = Int8Weight | Int4Weight
