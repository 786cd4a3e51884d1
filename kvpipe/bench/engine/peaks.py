"""The machine's rates measured in a `kvpipe bench engine` run, and the run's rows set against
them (floor.py computes the floors).

- memory read bandwidth: torch.sum over a buffer far larger than any last-level cache (256 MiB of
  fp32), on the run's torch threads: bytes / the fastest of a few passes. A sum does one add per
  4 bytes read, so it is bound by the memory, not the FMAs (the same stream a batch-1 decode step's
  weight panels are);
- matmul peak: torch.matmul of two n x n matrices in the dtype the model computes in (fp32
  through MKL/oneDNN's fp32 GEMM; bf16 through oneDNN's brgemm, on AMX or AVX-512-BF16 where the
  CPU has them): 2 n^3 / the fastest of a few products; n = 2,048, or less where one such product
  takes over a tenth of a second (matmul_size: bf16 without bf16 units).
Fastest, not median: a floor is what the hardware can do, and a shared machine only ever slows a
pass down; the run measures both before and after its points and keeps the better (Peaks.best).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpipe.bench.engine.floor import Peaks, decode_floor_fields, prefill_floor_fields
from kvpipe.engine.engine import Engine
from kvpipe.model.checkpoint.loader import resolve_dtype

BANDWIDTH_BYTES = 256 << 20
MATMUL_N = 2048
MATMUL_MIN_N = 256
MATMUL_PASS_S = 0.1  # matmul_size: a pass this long is long enough to time
PASSES = 5
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fastest(fn, passes: int) -> float:
    fn()  # fault the pages in, pick the kernels
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, passes: int = PASSES) -> float:
    """Bytes per second torch.sum reads over `nbytes` of fp32."""
    buf = torch.ones(nbytes // 4)
    return nbytes / _fastest(lambda: buf.sum(), passes)


def matmul_size(pass_seconds: Callable[[int], float], largest: int = MATMUL_N) -> int:
    """The n of the peak's product: doubling from MATMUL_MIN_N while one n x n x n pass takes under
    MATMUL_PASS_S, up to `largest`. A CPU without bf16 units runs torch's bf16 matmul on a slow
    fallback (an AVX2 EPYC: a tiny `--dtype bfloat16` run spent over 600 s measuring its peak on
    2,048-cube passes); there the peak is measured on a product that takes a fraction of a
    second, and elsewhere on the largest."""
    n = MATMUL_MIN_N
    while n < largest and pass_seconds(n) < MATMUL_PASS_S:
        n *= 2
    return min(n, largest)


def matmul_flops(dtype: str, n: int | None = None, passes: int = PASSES) -> float:
    """FLOP/s of an n x n x n torch.matmul in `dtype` (n: matmul_size's when None)."""
    torch_dtype = COMPUTE_DTYPES[dtype]
    g = torch.Generator().manual_seed(0)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randn(size, size, generator=g).to(torch_dtype),
            torch.randn(size, size, generator=g).to(torch_dtype),
        )

    def one_pass(size: int) -> float:
        a, b = operands(size)
        return _fastest(lambda: torch.matmul(a, b), 1)

    a, b = operands(n or matmul_size(one_pass))
    return 2.0 * a.shape[0] ** 3 / _fastest(lambda: torch.matmul(a, b), passes)


def measure_peaks(dtype: str) -> Peaks:
    """Both rates, for a model computing in `dtype` (fp32 for --quantization's kernels)."""
    return Peaks(bandwidth=read_bandwidth(), flops=matmul_flops(dtype), dtype=dtype)


def compute_dtype(args: argparse.Namespace, engine: Engine) -> str:
    """The dtype the model's matmuls run in: --dtype resolved as the loader does (auto: fp32 on
    the CPU); --quantization's kernels compute in fp32."""
    if args.quantization not in (None, "none"):
        return "float32"
    dtype = resolve_dtype(None if args.dtype == "auto" else args.dtype, engine.model_config, "cpu")
    return str(dtype).removeprefix("torch.")


def with_floors(
    engine: Engine,
    quantization: str | None,
    peaks: Peaks,
    dtype: str,
    kv_dtype: str,
    prefill: list[dict[str, Any]],
    decode: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every row with its floor (floor.py): prefill against the matmul peak, decode against the
    bandwidth (the whole model's bytes: TP ranks on one machine share its memory)."""
    cfg = engine.model_config
    rows_p = [prefill_floor_fields(r, cfg, peaks) for r in prefill]
    rows_d = [decode_floor_fields(r, cfg, peaks, dtype, quantization, kv_dtype) for r in decode]
    return rows_p, rows_d
