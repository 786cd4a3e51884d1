"""The panel kernels (weight_only.cpp) built for the CPUs this machine is not: AVX2 without
AVX-512 (32-column panels, 2-row tiles) and no SIMD at all (the scalar Vec), from the same source.
Each must give the product within the bound of any summation order and a row's bits alone or in
a batch, as the -march=native build does on every machine `make test` runs on. Slow: two
compiles."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpipe.model.cpu.kernels import loader
from kvpipe.model.quant.weights import Int4Weight, Int8Weight
from tests.helpers.tolerance import matmul_bound

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA flags"),
]
ISAS = {"avx2": ("-mno-avx512f",), "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-avx")}


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_panel_kernels_without_avx512(isa: str, tmp_path: Path) -> None:
    ext = loader.build(
        Path(loader.__file__).parent / "weight_only.cpp",
        tmp_path,
        name=f"kvpipe_weight_only_{isa}",
        extra_cflags=ISAS[isa],
    )
    pw = int(ext.f32_panel_width())
    assert pw == 32  # 4 vectors of 8 lanes, AVX2's and the scalar Vec's
    g = torch.Generator().manual_seed(1)
    for n, k in [(70, 64), (130, 96), (33, 32)]:
        w = torch.randn(n, k, generator=g)
        p = -(-n // pw)
        panels = F.pad(w, (0, 0, 0, p * pw - n)).view(p, pw, k).transpose(1, 2).contiguous()
        q8, q4 = Int8Weight.quantize(w), Int4Weight.quantize(w)
        d8, d4 = q8.dequantize(), q4.dequantize()
        m4 = d4.abs() + q4.minimum.abs().repeat_interleave(32, 1)  # what the kernel forms (terms may cancel)
        q8.pack(pw)
        q4.pack(pw)
        x = torch.randn(7, k, generator=g)
        for y, deq, mag in (
            (ext.f32_panel_linear(x, panels, n), w, w),
            (ext.int8_panel_linear(x, q8.q, q8.scale, n), d8, d8),
            (ext.int4_panel_linear(x, q4.codes, q4.scale, q4.minimum, n), d4, m4),
        ):
            assert bool(((y.double() - x.double() @ deq.double().T).abs() <= 2 * matmul_bound(x, mag)).all())
        one = ext.f32_panel_linear(x[2:3].contiguous(), panels, n)
        assert torch.equal(one[0], ext.f32_panel_linear(x, panels, n)[2])
