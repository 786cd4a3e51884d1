"""Decode step time of the C++ paged decode kernel per KV cache dtype (issue 26), one layer.

    python -m kvpipe.bench.engine.kv_kernel --contexts 1024,2048 --baseline old/paged_decode.cpp

SmolLM2-135M's attention shape (3 KV heads x 3 query heads each x 64, page 64) over `batch` rows
of `context` keys on consecutive pages, keys and values in separate pools as KVPool holds them.
Every (kernel, dtype) pair runs once per repeat, interleaved, and the minimum over the repeats is
kept: on a shared machine the least disturbed run is the one that measures the code. Ratios are
against fp32 of the same kernel in the same run. --baseline builds another source of the kernel
(e.g. main's paged_decode.cpp copied aside) under another module name, into the same process."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kvpipe.cache.kv_dtype import quantize
from kvpipe.model.cpu.kernels.loader import build

DTYPES = {
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    kv_heads: int = 3
    group: int = 3
    head_dim: int = 64
    page: int = 64

    @property
    def pages_per_row(self) -> int:
        return -(-self.context // self.page)


@dataclass(frozen=True)
class Case:
    """One layer's inputs: q [B, Hq, D], k and v [B * n + 1, Hkv, P, D] (page 0 unused)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pages: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor


def make_case(shape: Shape, dtype: torch.dtype, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    n, b = shape.pages_per_row, shape.batch
    pool = (b * n + 1, shape.kv_heads, shape.page, shape.head_dim)
    k = quantize(torch.randn(pool, generator=gen), dtype)
    v = quantize(torch.randn(pool, generator=gen), dtype)
    q = torch.randn(b, shape.kv_heads * shape.group, shape.head_dim, generator=gen)
    pages = torch.arange(1, b * n + 1).view(b, n)
    return Case(q, k, v, pages, torch.full((b,), shape.context), torch.zeros(b, dtype=torch.long))


def time_calls(ext: ModuleType, case: Case, calls: int) -> tuple[float, float]:
    """Mean wall and CPU (all threads) seconds per call over `calls` calls after a warm-up call."""
    c, scale = case, case.q.shape[-1] ** -0.5
    ext.paged_decode(c.q, c.k, c.v, c.pages, c.lens, c.starts, 0, None, scale, 1.0, 1.0)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        ext.paged_decode(c.q, c.k, c.v, c.pages, c.lens, c.starts, 0, None, scale, 1.0, 1.0)
    return (time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="1024,2048", help="comma-separated context lengths")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timings per (kernel, dtype); min kept")
    ap.add_argument("--baseline", type=Path, help="another paged_decode.cpp to time alongside this one")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = {"this": build()}
    if args.baseline is not None:
        base_dir = Path(os.environ.get("KVPIPE_KERNEL_DIR", tempfile.gettempdir())) / "baseline"
        kernels["baseline"] = build(source=args.baseline, directory=base_dir, name="kvpipe_paged_decode_baseline")
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    print(f"load average {os.getloadavg()}, {args.threads} threads, batch {args.batch}")
    print("| context | kernel | KV dtype | ms per layer (min) | vs fp32 | CPU ms (min) | KV MiB per layer |")
    print("|---|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        shape = Shape(args.batch, context)
        cases = {d: make_case(shape, DTYPES[d]) for d in dtypes}
        best = {(kn, d): float("inf") for kn in kernels for d in dtypes}
        cpu = dict(best)
        for _ in range(args.repeats):
            for kn, ext in kernels.items():
                for d in dtypes:
                    wall, used = time_calls(ext, cases[d], args.calls)
                    best[kn, d], cpu[kn, d] = min(best[kn, d], wall), min(cpu[kn, d], used)
        for kn in kernels:
            for d in dtypes:
                ms, ratio = best[kn, d] * 1e3, "-"
                if "fp32" in dtypes:
                    ratio = f"{best[kn, d] / best[kn, 'fp32']:.2f}x"
                mib = shape.batch * context * shape.kv_heads * shape.head_dim * 2 * cases[d].k.element_size() / 2**20
                print(f"| {context:,} | {kn} | {d} | {ms:#.3g} | {ratio} | {cpu[kn, d] * 1e3:#.3g} | {mib:#.3g} |")
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
