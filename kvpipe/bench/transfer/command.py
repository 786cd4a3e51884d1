"""`kvpipe bench transfer`: KV transfer goodput between a prefill and a decode process.

Each process owns a real KVPool and a real Mooncake engine (TCP). Per prompt length the prefill
side plans the request's pages (vectorised planner), writes them into the decode pool (the
backend splits ops longer than --max-op-bytes into pieces), and in the same run moves the same
number of bytes raw, driving the engine directly: as one contiguous op, and as pieces x window
patterns (--raw-pieces x --raw-windows, or the full grid with --raw-sweep), the fastest of which
is timed again interleaved with kvpipe. Reported: goodput (bytes / wall time, planning included),
kvpipe with unsplit ops (or split at each of --compare-split), one-op raw and best-raw goodput,
kvpipe / best-raw, planned ops and wire pieces per request, planning time, with medians over
--repeat and a digest check that the pages really landed.

--prefill-tp P --decode-tp D (heterogeneous TP, real head slicing; tp.py) compares, in
the same run and for the same request, one-rank same-TP transfer of equal bytes, plain head-slice
ops and staged chunks through the decode's staging rings (--staging on|auto), over the real
control plane.

--link-rate RATE runs the two processes in two network namespaces joined by a rate-limited veth
(root). Without it both ends use loopback.

Example: kvpipe bench transfer --preset bench --prompt-lens 1024,4096 --repeat 5 --json
         kvpipe bench transfer --preset bench --prompt-lens 1024,16384 --raw-sweep
         kvpipe bench transfer --prefill-tp 1 --decode-tp 2 --staging on --fragmentation 1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import ExitStack
from typing import Any

from kvpipe.bench.transfer import tp
from kvpipe.bench.transfer.config import TPConfig, WorkerConfig
from kvpipe.bench.transfer.prefill import prefill_main
from kvpipe.bench.transfer.process_pair import run_pair
from kvpipe.bench.transfer.procs import decode_main
from kvpipe.bench.transfer.raw_mooncake import RawPattern, fmt_bytes, parse_bytes
from kvpipe.bench.transfer.report import format_table, format_tp_table, summarize, summarize_tp
from kvpipe.bench.transfer.shapes import EXTRA_SHAPES, KVShape, lookup_shape, shape_names
from kvpipe.harness.testbed import LinkTestbed
from kvpipe.transfer.backends.mooncake import DEFAULT_MAX_OP_BYTES

# --kv-cache-dtype -> the torch dtype name the pools are made of
KV_TORCH_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

# Raw patterns timed by default, around the best of the full sweep (docs/benchmarks.md), and the sweep grid.
RAW_PIECES = (1 << 20, 4 << 20, 8 << 20)
RAW_WINDOWS = (16, 256)
SWEEP_PIECES = tuple(1 << k for k in range(16, 25))  # 64 KiB .. 16 MiB
SWEEP_WINDOWS = (8, 16, 32, 64, 128, 256)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", default="1024,4096", help="comma-separated prompt lengths in tokens")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--preset",
        default="bench",
        help="KV shape: a model preset (tiny, bench, tiny-qwen3.5, ...) or one of " + ", ".join(EXTRA_SHAPES),
    )
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset's KV heads")
    p.add_argument("--head-dim", type=int, default=None, help="override the preset's head_dim")
    p.add_argument("--dtype", default=None, help="override the KV dtype (float32, bfloat16, float16)")
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=sorted(KV_TORCH_NAMES),
        help="the KV pool's dtype by the server flag's names (fp8: 1-byte elements); KV-only shapes",
    )
    p.add_argument("--repeat", type=int, default=5, help="transfers per length (medians are reported)")
    p.add_argument(
        "--fragmentation",
        type=float,
        default=0.0,
        help="probability that a decode page starts a new run: 0 = one contiguous run, 1 = every page apart",
    )
    p.add_argument("--window", type=int, default=256, help="Mooncake ops (pieces) in flight per peer")
    p.add_argument(
        "--max-op-bytes",
        default=fmt_bytes(DEFAULT_MAX_OP_BYTES),
        help="kvpipe's backend splits longer ops into pieces of this size (e.g. 1M; 0: never split)",
    )
    p.add_argument(
        "--compare-split",
        default="0",
        help="also time kvpipe split at these sizes, interleaved (comma-separated; 0: unsplit)",
    )
    p.add_argument(
        "--raw-pieces",
        default=",".join(map(fmt_bytes, RAW_PIECES)),
        help="raw patterns: piece sizes (comma-separated, K/M suffixes)",
    )
    p.add_argument("--raw-windows", default=",".join(map(str, RAW_WINDOWS)), help="raw patterns: windows")
    p.add_argument(
        "--raw-sweep",
        action="store_true",
        help="raw patterns: the full grid (pieces 64K..16M x windows 8..256) and its table",
    )
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill TP ranks (heterogeneous-TP mode when != decode)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks")
    p.add_argument(
        "--staging",
        choices=["on", "auto"],
        default=None,
        help="heterogeneous-TP mode: how the staged variant stages (default on)",
    )
    p.add_argument("--staging-pool-mb", type=int, default=64, help="staging ring / buffer per rank (MB)")
    p.add_argument("--link-rate", default=None, help="emulate a link of this rate (tc syntax, e.g. 2gbit); needs root")
    p.add_argument("--seed", type=int, default=0, help="seed of the KV bytes and page choices")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _shape(args: argparse.Namespace) -> KVShape:
    try:
        s = lookup_shape(args.preset)
    except ValueError as e:
        raise SystemExit(f"kvpipe bench transfer: {e}") from None
    if s is None:
        raise SystemExit(f"kvpipe bench transfer: unknown preset {args.preset!r}; choose from {shape_names()}")
    if s.latent and args.kv_heads not in (None, 1):
        raise SystemExit("kvpipe bench transfer: an MLA latent shape has one KV head (--kv-heads 1)")
    if (s.hybrid is not None or s.sliding_layers) and args.layers is not None:
        # the layer map (which layers keep KV, which a state, which a window) comes with the shape
        raise SystemExit(
            "kvpipe bench transfer: a hybrid or sliding-window shape's layers are fixed by its layer map (no --layers)"
        )
    kv_dtype = getattr(args, "kv_cache_dtype", None)
    if kv_dtype is not None and s.hybrid is not None:
        # the shape's dtype is also its conv state's, which keeps the model dtype
        raise SystemExit("kvpipe bench transfer: --kv-cache-dtype is for KV-only shapes, not a hybrid one")
    return KVShape(
        args.layers or s.num_layers,
        args.kv_heads or s.kv_heads,
        args.head_dim or s.head_dim,
        KV_TORCH_NAMES[kv_dtype] if kv_dtype else args.dtype or s.dtype,
        s.latent,
        s.hybrid,
        s.sliding_layers,
        s.sliding_window,
    )


def config_from_args(
    args: argparse.Namespace, log_path: str, hostname: str = "127.0.0.1", netns: str | None = None
) -> WorkerConfig:
    lens = tuple(int(x) for x in str(args.prompt_lens).split(",") if x.strip())
    if not lens or min(lens) <= 0 or args.page_size <= 0 or args.repeat <= 0:
        raise SystemExit("kvpipe bench transfer: prompt lengths, --page-size and --repeat must be positive")
    if not 0.0 <= args.fragmentation <= 1.0:
        raise SystemExit("kvpipe bench transfer: --fragmentation must be in [0, 1]")
    s = _shape(args)
    max_op = _sizes(args.max_op_bytes, "--max-op-bytes", 0)
    if len(max_op) != 1:
        raise SystemExit("kvpipe bench transfer: --max-op-bytes takes one size (--compare-split takes several)")
    return WorkerConfig(
        s.num_layers,
        s.kv_heads,
        s.head_dim,
        s.dtype,
        args.page_size,
        lens,
        args.repeat,
        args.fragmentation,
        args.window,
        args.seed,
        log_path,
        hostname,
        netns,
        max_op_bytes=max_op[0] or None,
        raw_patterns=raw_patterns(args),
        compare_max_op_bytes=_sizes(args.compare_split, "--compare-split", 0),
        latent=s.latent,
        hybrid=s.hybrid,
        sliding_layers=s.sliding_layers,
        sliding_window=s.sliding_window,
    )


def _sizes(text: str, flag: str, least: int) -> tuple[int, ...]:
    """'0,64K,1M' -> byte counts, each >= least."""
    try:
        sizes = tuple(parse_bytes(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"kvpipe bench transfer: {flag} takes sizes like 64K,1M,4096, got {text!r}") from None
    if not sizes or min(sizes) < least:
        raise SystemExit(f"kvpipe bench transfer: {flag} sizes must be >= {least}, got {text!r}")
    return sizes


def raw_patterns(args: argparse.Namespace) -> tuple[RawPattern, ...]:
    pieces: tuple[int, ...]
    windows: tuple[int, ...]
    if args.raw_sweep:
        pieces, windows = SWEEP_PIECES, SWEEP_WINDOWS
    else:
        pieces, windows = _sizes(args.raw_pieces, "--raw-pieces", 1), _sizes(args.raw_windows, "--raw-windows", 1)
    if max(windows) > 1024:
        raise SystemExit("kvpipe bench transfer: --raw-windows must be in (0, 1024]")
    return tuple(RawPattern(p, w) for p in pieces for w in windows)


def tp_mode(args: argparse.Namespace) -> bool:
    return args.prefill_tp != args.decode_tp or args.staging is not None


def tp_config_from_args(
    args: argparse.Namespace, log_path: str, prefill_host: str, hostname: str = "127.0.0.1", netns: str | None = None
) -> TPConfig:
    w = config_from_args(args, log_path, hostname, netns)
    if w.latent:
        raise SystemExit(
            "kvpipe bench transfer: heterogeneous-TP mode compares head slicing and staging; an MLA "
            "latent is replicated on every rank and never sliced (each decode rank reads one "
            "prefill rank's latent, as in same-TP mode)"
        )
    if w.hybrid is not None:
        raise SystemExit(
            "kvpipe bench transfer: heterogeneous-TP mode moves KV only; a hybrid shape's state "
            "under TP is covered by tests/integration/test_state_transfer.py, not benchmarked"
        )
    if w.sliding_layers:
        raise SystemExit(
            "kvpipe bench transfer: heterogeneous-TP mode plans every page of every layer; a "
            "sliding-window shape's window pages under TP are covered by "
            "tests/integration/test_swa_transfer.py, not benchmarked"
        )
    if min(args.prefill_tp, args.decode_tp) < 1 or max(args.prefill_tp, args.decode_tp) % min(
        args.prefill_tp, args.decode_tp
    ):
        raise SystemExit("kvpipe bench transfer: one of --prefill-tp / --decode-tp must divide the other")
    return TPConfig(
        w.num_layers,
        w.kv_heads,
        w.head_dim,
        w.dtype,
        w.page_size,
        w.prompt_lens,
        w.repeat,
        w.fragmentation,
        w.window,
        w.seed,
        log_path,
        args.prefill_tp,
        args.decode_tp,
        args.staging or "on",
        args.staging_pool_mb,
        prefill_host,
        hostname,
        netns,
    )


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start both processes (inside an emulated link when asked), collect the prefill's report."""
    with ExitStack() as stack:
        logdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpipe-bench-transfer-"))
        prefill_log, decode_log = os.path.join(logdir, "prefill.log"), os.path.join(logdir, "decode.log")
        (p_host, p_ns), (d_host, d_ns) = ("127.0.0.1", None), ("127.0.0.1", None)
        if args.link_rate:
            link = stack.enter_context(LinkTestbed(args.link_rate))
            (p_host, p_ns), (d_host, d_ns) = (link.addr_a, link.ns_a), (link.addr_b, link.ns_b)
        if tp_mode(args):
            tp_p = tp_config_from_args(args, prefill_log, p_host, p_host, p_ns)
            tp_d = tp_config_from_args(args, decode_log, p_host, d_host, d_ns)
            return summarize_tp(
                run_pair(tp.decode_main, tp.prefill_main, tp_d, tp_p, args.timeout),
                tp_p,
                args.link_rate,
            )
        pcfg = config_from_args(args, prefill_log, p_host, p_ns)
        dcfg = config_from_args(args, decode_log, d_host, d_ns)
        return summarize(run_pair(decode_main, prefill_main, dcfg, pcfg, args.timeout), pcfg, args.link_rate)


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    report = run_bench(args)
    if args.json:
        print(json.dumps(report))
    elif report.get("mode") == "tp":
        print(format_tp_table(report))
    else:
        print(format_table(report, sweep=args.raw_sweep))
    return 0 if report["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench transfer", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
