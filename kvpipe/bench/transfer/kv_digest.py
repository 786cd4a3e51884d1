"""What end-to-end KV integrity costs (--disaggregation-kv-integrity, transfer/kv_digest.py): the
time of one digest of a room's KV per MB it covers, on each side (the prefill's over its pages
once the writes landed, the decode's over its own before the first decode step), next to bare
BLAKE2b over the same bytes already in one buffer (what the gather of the pages adds).

    python -m kvpipe.bench.transfer.kv_digest [--mb 64] [--repeat 5] [--dtype bfloat16] [--page-size 64]
    -> one JSON line: {"mb", "digest_ms_per_mb", "digest_mb_per_s", "blake2b_ms_per_mb", ...}

Medians of `repeat` runs; a shared, noisy machine is read by its median."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import numpy as np
import torch

from kvpipe.transfer.kv_digest import KEY_BYTES, KVDigester
from kvpipe.transfer.planning.layout import KVLayout

LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 128


def pool(mb: int, dtype: torch.dtype, page_size: int) -> tuple[list[torch.Tensor], KVLayout, np.ndarray]:
    """A pool whose every page one room holds, `mb` MiB of KV in all (random bytes, scattered pages)."""
    itemsize = torch.finfo(dtype).bits // 8
    page_nbytes = KV_HEADS * page_size * HEAD_DIM * itemsize
    pages = max(1, (mb << 20) // (2 * LAYERS * page_nbytes))
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(pages, KV_HEADS, page_size, HEAD_DIM, generator=g).to(dtype) for _ in range(2 * LAYERS)]
    layout = KVLayout(
        LAYERS,
        page_size,
        KV_HEADS,
        0,
        KV_HEADS,
        HEAD_DIM,
        str(dtype).removeprefix("torch."),
        itemsize,
        tuple(b.data_ptr() for b in bufs),
        pages * page_nbytes,
    )
    order = np.random.default_rng(0).permutation(pages)  # a room's pages are not contiguous in a pool
    return bufs, layout, order


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="MiB of KV one digest covers (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args(argv)
    bufs, layout, pages = pool(args.mb, getattr(torch, args.dtype), args.page_size)
    digester, key = KVDigester(bufs, layout), bytes(KEY_BYTES)
    nbytes = sum(b.numel() * b.element_size() for b in bufs)
    flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in bufs]).numpy()

    def timed(fn) -> float:
        runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    digest_s = timed(lambda: digester.digest(key, pages, (0, KV_HEADS)))
    blake_s = timed(lambda: hashlib.blake2b(flat.data, digest_size=16, key=key).digest())
    mb = nbytes / (1 << 20)
    out = {
        "mb": round(mb, 1),
        "dtype": args.dtype,
        "page_size": args.page_size,
        "digest_ms_per_mb": round(1e3 * digest_s / mb, 3),
        "digest_mb_per_s": round(mb / digest_s, 1),
        "blake2b_ms_per_mb": round(1e3 * blake_s / mb, 3),
        "blake2b_mb_per_s": round(mb / blake_s, 1),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
