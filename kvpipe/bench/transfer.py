"""`kvpipe bench transfer`: KV transfer goodput between a prefill and a decode process.

Each process owns a real KVPool and a real Mooncake engine (TCP). Per prompt length the prefill
side plans the request's pages (vectorised planner), writes them into the decode pool, and in the
same run moves the same number of bytes as one contiguous op (the raw engine goodput). Reported:
goodput (bytes / wall time, planning included), raw goodput, their ratio, ops per request and
planning time, with medians over --repeat and a digest check that the pages really landed.

--prefill-tp P --decode-tp D (heterogeneous TP, real head slicing; transfer_tp.py) compares, in
the same run and for the same request, one-rank same-TP transfer of equal bytes, plain head-slice
ops and staged chunks through the decode's staging rings (--staging on|auto), over the real
control plane.

--link-rate RATE runs the two processes in two network namespaces joined by a rate-limited veth
(root). Without it both ends use loopback.

Example: kvpipe bench transfer --preset bench --prompt-lens 1024,4096 --repeat 5 --json
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
from kvpipe.bench.transfer_worker import WorkerConfig, decode_main, prefill_main

# Shapes (num_layers, kv_heads, head_dim, dtype) besides the model presets in kvpipe.model.presets.
EXTRA_SHAPES: dict[str, tuple[int, int, int, str]] = {
    "llama3-8b": (32, 8, 128, "bfloat16"),  # 128 KiB of KV per token
    "qwen2-0.5b": (24, 2, 64, "bfloat16"),  # 12 KiB per token
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", default="1024,4096", help="comma-separated prompt lengths in tokens")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--preset", default="bench",
                   help="KV shape: a model preset (tiny, bench) or one of " + ", ".join(EXTRA_SHAPES))
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset's KV heads")
    p.add_argument("--head-dim", type=int, default=None, help="override the preset's head_dim")
    p.add_argument("--dtype", default=None, help="override the KV dtype (float32, bfloat16, float16)")
    p.add_argument("--repeat", type=int, default=5, help="transfers per length (medians are reported)")
    p.add_argument("--fragmentation", type=float, default=0.0,
                   help="probability that a decode page starts a new run: 0 = one contiguous run, 1 = every page apart")
    p.add_argument("--window", type=int, default=256, help="Mooncake ops in flight per peer")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill TP ranks (heterogeneous-TP mode when != decode)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks")
    p.add_argument("--staging", choices=["on", "auto"], default=None,
                   help="heterogeneous-TP mode: how the staged variant stages (default on)")
    p.add_argument("--staging-pool-mb", type=int, default=64, help="staging ring / buffer per rank (MB)")
    p.add_argument("--link-rate", default=None, help="emulate a link of this rate (tc syntax, e.g. 2gbit); needs root")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _shape(args: argparse.Namespace) -> tuple[int, int, int, str]:
    if args.preset in EXTRA_SHAPES:
        layers, heads, hd, dtype = EXTRA_SHAPES[args.preset]
    else:
        from kvpipe.model.presets import PRESETS

        if args.preset not in PRESETS:
            raise SystemExit(f"kvpipe bench transfer: unknown preset {args.preset!r}; "
                             f"choose from {sorted(PRESETS) + sorted(EXTRA_SHAPES)}")
        spec = PRESETS[args.preset]
        layers, heads, hd, dtype = spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32"
    return (args.layers or layers, args.kv_heads or heads, args.head_dim or hd, args.dtype or dtype)


def config_from_args(args: argparse.Namespace, log_path: str, hostname: str = "127.0.0.1",
                     netns: str | None = None) -> WorkerConfig:
    lens = tuple(int(x) for x in str(args.prompt_lens).split(",") if x.strip())
    if not lens or min(lens) <= 0 or args.page_size <= 0 or args.repeat <= 0:
        raise SystemExit("kvpipe bench transfer: prompt lengths, --page-size and --repeat must be positive")
    if not 0.0 <= args.fragmentation <= 1.0:
        raise SystemExit("kvpipe bench transfer: --fragmentation must be in [0, 1]")
    layers, heads, hd, dtype = _shape(args)
    return WorkerConfig(layers, heads, hd, dtype, args.page_size, lens, args.repeat, args.fragmentation,
                        args.window, args.seed, log_path, hostname, netns)


def tp_mode(args: argparse.Namespace) -> bool:
    return args.prefill_tp != args.decode_tp or args.staging is not None


def tp_config_from_args(args: argparse.Namespace, log_path: str, prefill_host: str, hostname: str = "127.0.0.1",
                        netns: str | None = None) -> transfer_tp.TPConfig:
    w = config_from_args(args, log_path, hostname, netns)
    if min(args.prefill_tp, args.decode_tp) < 1 or max(args.prefill_tp, args.decode_tp) % min(args.prefill_tp,
                                                                                             args.decode_tp):
        raise SystemExit("kvpipe bench transfer: one of --prefill-tp / --decode-tp must divide the other")
    return transfer_tp.TPConfig(w.num_layers, w.kv_heads, w.head_dim, w.dtype, w.page_size, w.prompt_lens, w.repeat,
                                w.fragmentation, w.window, w.seed, log_path, args.prefill_tp, args.decode_tp,
                                args.staging or "on", args.staging_pool_mb, prefill_host, hostname, netns)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Start both processes (inside an emulated link when asked), collect the prefill's report."""
    from kvpipe.bench.testbed import LinkTestbed

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
        procs = [ctx.Process(target=mod.decode_main if tp else decode_main, args=(dcfg, d_peer), name="bench-decode",
                             daemon=True),
                 ctx.Process(target=mod.prefill_main if tp else prefill_main, args=(pcfg, p_peer, to_parent),
                             name="bench-prefill", daemon=True)]
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
            raise RuntimeError(f"transfer benchmark failed: {msg[1]}\n" +
                               "\n".join(f"--- {n} ---\n{t}" for n, t in tails.items()))
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
    return {
        "goodput_gbps": total / kv_s / 1e9,  # over all lengths: sum of bytes / sum of median times
        "raw_goodput_gbps": total / raw_s / 1e9,
        "goodput_ratio": raw_s / kv_s,
        "ops_per_request": statistics.mean(x["ops_per_request"] for x in lengths),
        "planning_ms": statistics.median(x["planning_ms"] for x in lengths),
        "verified": all(x["verified"] for x in lengths),
        "lengths": lengths,
        "config": {"layers": cfg.num_layers, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                   "dtype": cfg.dtype, "page_size": cfg.page_size, "repeat": cfg.repeat,
                   "fragmentation": cfg.fragmentation, "window": cfg.window, "protocol": "tcp",
                   "link_rate": link_rate or "loopback", "engine_generation": result["engine_generation"]},
    }


def format_table(report: dict[str, Any]) -> str:
    c = report["config"]
    rows = [f"KV {c['layers']}L x {c['kv_heads']}H x {c['head_dim']}D {c['dtype']}, page {c['page_size']}, "
            f"fragmentation {c['fragmentation']}, link {c['link_rate']}, median of {c['repeat']}",
            f"{'tokens':>7} {'MiB':>8} {'ops':>6} {'plan ms':>8} {'xfer ms':>9} {'GB/s':>7} {'raw GB/s':>9} "
            f"{'ratio':>6} ok"]
    for x in report["lengths"]:
        rows.append(f"{x['prompt_len']:>7} {x['bytes'] / 2**20:>8.1f} {x['ops_per_request']:>6} "
                    f"{x['planning_ms']:>8.3f} {x['transfer_ms']:>9.2f} {x['goodput_gbps']:>7.2f} "
                    f"{x['raw_goodput_gbps']:>9.2f} {x['goodput_ratio']:>6.2f} {'yes' if x['verified'] else 'NO'}")
    rows.append(f"overall goodput {report['goodput_gbps']:.2f} GB/s vs raw {report['raw_goodput_gbps']:.2f} GB/s "
                f"(ratio {report['goodput_ratio']:.2f})")
    return "\n".join(rows)


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    report = run_bench(args)
    table = transfer_tp.format_table if report.get("mode") == "tp" else format_table
    print(json.dumps(report) if args.json else table(report))
    return 0 if report["verified"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench transfer", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
