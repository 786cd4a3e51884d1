"""`kvpipe bench transfer`: KV transfer goodput between a prefill and a decode process.

Each process owns a real KVPool and a real Mooncake engine (TCP). Per prompt length the prefill
side plans the request's pages (vectorised planner), writes them into the decode pool (the
backend splits ops longer than --max-op-bytes into pieces), and in the same run moves the same
number of bytes raw, driving the engine directly: as one contiguous op, and as pieces x window
patterns (--raw-pieces x --raw-windows, or the full grid with --raw-sweep), the fastest of which
is timed again interleaved with kvpipe. Reported: goodput (bytes / wall time, planning included),
kvpipe with unsplit ops (or split at each of --compare-split), one-op raw and best-raw goodput, kvpipe / best-raw, planned ops and wire
pieces per request, planning time, with medians over --repeat and a digest check that the pages
really landed.

--prefill-tp P --decode-tp D (heterogeneous TP, real head slicing; transfer_tp.py) compares, in
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
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from kvpipe.bench import transfer_tp
from kvpipe.bench.raw_mooncake import WHOLE, RawPattern, fmt_bytes, parse_bytes
from kvpipe.bench.transfer_procs import WorkerConfig, decode_main, prefill_main
from kvpipe.bench.transfer_shapes import EXTRA_SHAPES, KVShape, lookup_shape, shape_names
from kvpipe.transfer.backends.mooncake import DEFAULT_MAX_OP_BYTES

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
    p.add_argument("--seed", type=int, default=0)
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
    return KVShape(
        args.layers or s.num_layers,
        args.kv_heads or s.kv_heads,
        args.head_dim or s.head_dim,
        args.dtype or s.dtype,
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
) -> transfer_tp.TPConfig:
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
    return transfer_tp.TPConfig(
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
    from kvpipe.qa.testbed import LinkTestbed

    with ExitStack() as stack:
        logdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpipe-bench-transfer-"))
        ends = [("127.0.0.1", None), ("127.0.0.1", None)]
        if args.link_rate:
            link = stack.enter_context(LinkTestbed(args.link_rate))
            ends = [(link.addr_a, link.ns_a), (link.addr_b, link.ns_b)]
        tp = tp_mode(args)
        if tp:
            mod: Any = transfer_tp
            pcfg = tp_config_from_args(args, os.path.join(logdir, "prefill.log"), ends[0][0], *ends[0])
            dcfg = tp_config_from_args(args, os.path.join(logdir, "decode.log"), ends[0][0], *ends[1])
        else:
            mod = None
            pcfg = config_from_args(args, os.path.join(logdir, "prefill.log"), *ends[0])
            dcfg = config_from_args(args, os.path.join(logdir, "decode.log"), *ends[1])
        ctx = mp.get_context("spawn")  # fresh single-threaded children: safe to enter a netns
        p_peer, d_peer = ctx.Pipe()
        from_prefill, to_parent = ctx.Pipe(duplex=False)
        procs = [
            ctx.Process(
                target=mod.decode_main if tp else decode_main, args=(dcfg, d_peer), name="bench-decode", daemon=True
            ),
            ctx.Process(
                target=mod.prefill_main if tp else prefill_main,
                args=(pcfg, p_peer, to_parent),
                name="bench-prefill",
                daemon=True,
            ),
        ]
        for proc in procs:
            proc.start()
        try:
            deadline = time.monotonic() + args.timeout
            while not from_prefill.poll(0.2):
                if time.monotonic() > deadline or not procs[1].is_alive():
                    break
            msg = from_prefill.recv() if from_prefill.poll(0) else ("error", "prefill process died or timed out")
            for proc in procs:
                proc.join(timeout=30)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=10)
        if msg[0] != "result":
            tails = {n: _tail(os.path.join(logdir, n)) for n in ("prefill.log", "decode.log")}
            raise RuntimeError(
                f"transfer benchmark failed: {msg[1]}\n" + "\n".join(f"--- {n} ---\n{t}" for n, t in tails.items())
            )
        return (transfer_tp.summarize if tp else summarize)(msg[1], pcfg, args.link_rate)


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def summarize(result: dict[str, Any], cfg: WorkerConfig, link_rate: str | None) -> dict[str, Any]:
    lengths = result["lengths"]
    total = sum(x["bytes"] for x in lengths)
    kv_s = sum(x["transfer_ms"] for x in lengths) / 1e3
    raw_s = sum(x["raw_ms"] for x in lengths) / 1e3
    best_s = sum(x["best_raw_ms"] for x in lengths) / 1e3
    return {
        "goodput_gbps": total / kv_s / 1e9,  # over all lengths: sum of bytes / sum of median times
        "raw_goodput_gbps": total / raw_s / 1e9,  # one raw op of all the bytes
        "best_raw_goodput_gbps": total / best_s / 1e9,  # each length's fastest raw pattern
        "goodput_ratio": raw_s / kv_s,
        "best_raw_ratio": best_s / kv_s,  # kvpipe / best raw
        "best_raw_ratio_paired": statistics.median(x["best_raw_ratio_paired"] for x in lengths),
        "ops_per_request": statistics.mean(x["ops_per_request"] for x in lengths),
        "pieces_per_request": statistics.mean(x["pieces_per_request"] for x in lengths),
        "planning_ms": statistics.median(x["planning_ms"] for x in lengths),
        "verified": all(x["verified"] for x in lengths),
        "lengths": lengths,
        "config": {
            "layers": cfg.num_layers,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "latent": cfg.latent,
            "dtype": cfg.dtype,
            "page_size": cfg.page_size,
            "repeat": cfg.repeat,
            "fragmentation": cfg.fragmentation,
            "window": cfg.window,
            "max_op_bytes": cfg.max_op_bytes,
            "raw_patterns": [p.label for p in cfg.raw_patterns],
            "compare_max_op_bytes": list(cfg.compare_max_op_bytes),
            "protocol": "tcp",
            "link_rate": link_rate or "loopback",
            "engine_generation": result["engine_generation"],
            **_hybrid_config(cfg),
            **_sliding_config(cfg),
        },
    }


def _sliding_config(cfg: WorkerConfig) -> dict[str, Any]:
    """A sliding-window shape's layer map and window, for the report (nothing otherwise)."""
    if not cfg.sliding_layers:
        return {}
    return {"sliding_layers": list(cfg.sliding_layers), "sliding_window": cfg.sliding_window}


def _hybrid_config(cfg: WorkerConfig) -> dict[str, Any]:
    """A hybrid shape's layer map and state size, for the report (nothing for a KV-only shape)."""
    h = cfg.hybrid
    if h is None:
        return {}
    return {
        "model_layers": len(h.layer_types),
        "kv_layers": list(h.full_layers),
        "linear_layers": len(h.linear_layers),
        "linear_key_heads": h.linear_key_heads,
        "linear_value_heads": h.linear_value_heads,
        "linear_key_head_dim": h.linear_key_head_dim,
        "linear_value_head_dim": h.linear_value_head_dim,
        "conv_kernel": h.conv_kernel,
    }


def format_table(report: dict[str, Any], sweep: bool = False) -> str:
    c = report["config"]
    split = fmt_bytes(c["max_op_bytes"]) if c["max_op_bytes"] else "off"
    kind = "MLA latent" if c.get("latent") else "KV"
    hybrid = "model_layers" in c
    if hybrid:
        kind = (
            f"hybrid {c['model_layers']}L: state of {c['linear_layers']} linear layers ({c['linear_value_heads']} "
            f"value heads, {c['linear_key_head_dim']}x{c['linear_value_head_dim']}) + KV of"
        )
    rows = [
        f"{kind} {c['layers']}L x {c['kv_heads']}H x {c['head_dim']}D {c['dtype']}, page {c['page_size']}, "
        f"fragmentation {c['fragmentation']}, link {c['link_rate']}, window {c['window']}, split {split}, "
        f"median of {c['repeat']}; GB/s; paired: median of per-round kvpipe/best-raw"
    ]
    if hybrid:  # a request's bytes and ops split into KV and state; the goodput table counts both
        rows.append(f"{'tokens':>7} {'KV MiB':>8} {'state MiB':>9} {'KV ops':>6} {'state ops':>9}")
        rows += [
            f"{x['prompt_len']:>7} {x['kv_bytes'] / 2**20:>8.1f} {x['state_bytes'] / 2**20:>9.1f} "
            f"{x['kv_ops']:>6} {x['state_ops']:>9}"
            for x in report["lengths"]
        ]
    if "sliding_window" in c:  # the window pages against a bench of every page of every layer
        rows[0] = (
            f"{len(c['sliding_layers'])} of {c['layers']} layers sliding (window {c['sliding_window']}), " + rows[0]
        )
        rows.append(f"{'tokens':>7} {'KV MiB':>8} {'all pages MiB':>13} {'ratio':>6} {'window pages':>12}")
        rows += [
            f"{x['prompt_len']:>7} {x['kv_bytes'] / 2**20:>8.1f} {x['all_pages_bytes'] / 2**20:>13.1f} "
            f"{x['window_ratio']:>6.3f} {x['window_pages']:>12}"
            for x in report["lengths"]
        ]
    rows.append(
        f"{'tokens':>7} {'MiB':>8} {'ops':>5} {'pieces':>6} {'plan ms':>8} {'xfer ms':>8} {'kvpipe':>7} "
        f"{'unsplit':>7} {'raw 1op':>7} {'best raw':>8} {'pattern':>10} {'kv/best':>7} {'paired':>6} "
        f"{'kv/1op':>6} ok"
    )
    for x in report["lengths"]:
        rows.append(
            f"{x['prompt_len']:>7} {x['bytes'] / 2**20:>8.1f} {x['ops_per_request']:>5} "
            f"{x['pieces_per_request']:>6} {x['planning_ms']:>8.3f} {x['transfer_ms']:>8.2f} "
            f"{x['goodput_gbps']:>7.2f} {_gbps(x['unsplit_goodput_gbps']):>7} {x['raw_goodput_gbps']:>7.2f} "
            f"{x['best_raw_goodput_gbps']:>8.2f} {x['best_raw']['label']:>10} {x['best_raw_ratio']:>7.2f} "
            f"{x['best_raw_ratio_paired']:>6.2f} "
            f"{x['goodput_ratio']:>6.2f} {'yes' if x['verified'] else 'NO'}"
        )
    rows.append(
        f"overall goodput {report['goodput_gbps']:.2f} GB/s vs best raw {report['best_raw_goodput_gbps']:.2f} "
        f"(ratio {report['best_raw_ratio']:.2f}), vs one raw op {report['raw_goodput_gbps']:.2f} "
        f"(ratio {report['goodput_ratio']:.2f})"
    )
    if len(c["compare_max_op_bytes"]) > 1:
        rows += [
            f"kvpipe split at (GB/s), {x['prompt_len']} tokens: "
            + ", ".join(
                f"{fmt_bytes(s['max_op_bytes']) if s['max_op_bytes'] else 'off'} {s['goodput_gbps']:.2f}"
                for s in x["split_compare"]
            )
            for x in report["lengths"]
        ]
    if sweep:
        rows += [""] + [format_sweep(x) for x in report["lengths"]]
    return "\n".join(rows)


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_sweep(length: dict[str, Any]) -> str:
    """One length's raw sweep as a grid: piece size (rows) x window (columns) -> median GB/s."""
    cells = {(s["piece_bytes"], s["window"]): s["goodput_gbps"] for s in length["sweep"] if s["piece_bytes"] != WHOLE}
    one_op = next((s["goodput_gbps"] for s in length["sweep"] if s["piece_bytes"] == WHOLE), float("nan"))
    pieces = sorted({p for p, _ in cells})
    windows = sorted({w for _, w in cells})
    rows = [
        f"raw sweep, {length['prompt_len']} tokens ({length['bytes'] / 2**20:.1f} MiB), GB/s: piece \\ window "
        f"(one op: {one_op:.2f}; best: {length['best_raw']['label']})",
        f"{'piece':>6} " + " ".join(f"{w:>6}" for w in windows),
    ]
    for p in pieces:
        rows.append(
            f"{fmt_bytes(p):>6} " + " ".join(f"{cells[p, w]:>6.2f}" if (p, w) in cells else f"{'':>6}" for w in windows)
        )
    return "\n".join(rows)


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    report = run_bench(args)
    if args.json:
        print(json.dumps(report))
    elif report.get("mode") == "tp":
        print(transfer_tp.format_table(report))
    else:
        print(format_table(report, sweep=args.raw_sweep))
    return 0 if report["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench transfer", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
