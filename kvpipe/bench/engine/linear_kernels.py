"""The CPU linear kernels side by side: `python -m kvpipe.bench.engine.linear_kernels` (issue 31).

For each weight shape (default: SmolLM2-135M's q/k/v, gate/up, down and logits) and row count,
the same weights through every kernel the loader could give them: fp32 in column panels
(f32_panel_linear, the default), oneDNN's packed product (KVPIPE_PANEL_WEIGHTS=0's form), MKL on
the dense weight (F.linear), and the int8 and int4 codes in panels (int8_panel_linear,
int4_panel_linear: w8a16's and w4a16's default) against their row kernels (int8_linear,
int4_linear, the forms before panels; int4 needs K a multiple of 32). All weights sit in one
huge-page arena, as the loader places them. Per point: the median of --repeat timed passes over
enough copies of the weight (--bytes) that each pass streams it from memory, as a decode step does.
Reported: GMAC/s (rows x out x in per second) and, at one row, the weight bytes per second.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvpipe.model.cpu.huge_pages import place_weights, relocate
from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels
from kvpipe.model.cpu.packed_linear import pack_weight, packed_linear
from kvpipe.model.cpu.panel_weight import PanelWeight
from kvpipe.model.quant.weights import Int4Weight, Int8Weight

SMOLLM2 = "960x576,3072x576,576x1536,49152x576"  # [out, in]: q/k/v, gate/up, down, tied logits


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvpipe.bench.engine.linear_kernels", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SMOLLM2, help="comma-separated OUTxIN weight shapes")
    p.add_argument("--rows", default="1,8,32,512", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--bytes", type=float, default=200e6, help="fp32 bytes of weight copies per pass (above the caches)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ext = weight_only_kernels()
    if ext is None:
        raise SystemExit("linear_kernels: the C++ kernels are not built (KVPIPE_CPU_KERNELS=0 or no compiler)")
    g = torch.Generator().manual_seed(0)
    print(f"threads {args.threads}, panel width {int(ext.f32_panel_width())}; GMAC/s (GB/s of weights at 1 row)")
    heads = ("fp32 panels", "oneDNN", "MKL dense", "int8 panels", "int8 rows", "int4 panels", "int4 rows")
    print(f"{'shape':>11} {'rows':>4} " + " ".join(f"{h:>13}" for h in heads))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(1, int(args.bytes // (n * k * 4)))
        dense = relocate([torch.randn(n, k, generator=g) / k**0.5 for _ in range(copies)])
        panels = [PanelWeight.pack(w, ext) for w in dense]
        onednn = [pack_weight(w) for w in dense]
        int8_rows = [Int8Weight.quantize(w) for w in dense]
        int8_panels = [Int8Weight(*q.rows()) for q in int8_rows]
        int4_rows = [Int4Weight.quantize(w) for w in dense]
        int4_panels = [Int4Weight(*q.rows()) for q in int4_rows]
        quantized: list[Int8Weight | Int4Weight] = [*int8_panels, *int4_panels]
        for q in quantized:
            q.pack(int(ext.f32_panel_width()))
        place_weights(nn.ModuleList([*panels, *int8_rows, *int4_rows, *quantized]))  # the loader's arena
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            c = copies if rows < 64 else 1  # many rows: compute-bound, one copy is enough
            passes: list[tuple[Callable[[], object], float]] = [  # (one pass over c copies, bytes a weight)
                (partial(_each, panels[:c], partial(_call, x=x)), 4),
                (partial(_each, onednn[:c], partial(_onednn, x=x)), 4),
                (partial(_each, dense[:c], partial(_dense, x=x)), 4),
                (partial(_each, int8_panels[:c], partial(_int8_panels, ext=ext, x=x)), 1),
                (partial(_each, int8_rows[:c], partial(_int8_rows, ext=ext, x=x)), 1),
                (partial(_each, int4_panels[:c], partial(_call, x=x)), 0.5),
                (partial(_each, int4_rows[:c], partial(_call, x=x)), 0.5),
            ]
            cells = []
            for one_pass, width in passes:
                sec = _median_s(one_pass, args.repeat)
                gmac = rows * n * k * c / sec / 1e9
                cells.append(f"{gmac:.1f} ({n * k * width * c / sec / 1e9:.1f})" if rows == 1 else f"{gmac:.1f}")
            print(f"{shape:>11} {rows:>4} " + " ".join(f"{cell:>13}" for cell in cells), flush=True)


def _each(weights: list[Any], fn: Callable[[Any], object]) -> None:
    for w in weights:
        fn(w)


def _call(w: nn.Module, x: torch.Tensor) -> object:
    return w(x)


def _onednn(w: torch.Tensor, x: torch.Tensor) -> object:
    return packed_linear(x, w, None)


def _dense(w: torch.Tensor, x: torch.Tensor) -> object:
    return F.linear(x, w)


def _int8_panels(q: Int8Weight, ext: Any, x: torch.Tensor) -> object:
    return ext.int8_panel_linear(x, q.q, q.scale, q.out_features)


def _int8_rows(q: Int8Weight, ext: Any, x: torch.Tensor) -> object:
    return ext.int8_linear(x, q.q, q.scale)


if __name__ == "__main__":
    main()
