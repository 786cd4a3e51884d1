"""`kvpipe bench kv-store --workload multiturn`: prefix hit rate, TTFT and bytes moved of a
multi-turn, shared-prefix workload on a 2P2D stack through sglang-router, for round_robin and
cache_aware routing (both sides), each with and without the KV tier, next to one 1P1D instance.

The workload (bench/workload.py): --conversations conversations of --turns turns; conversation c
starts with shared prefix c % --prefix-groups (--shared-prefix tokens) and its own tokens up to
--first-turn; each later turn resends the conversation (its answer included) plus --turn-len new
tokens once the previous turn finished (closed loop, harness/driver.py), at most --concurrency at once.
The same requests run against each case, one stack after the other (fresh servers, a fresh store).

Per case: hit rate = prompt tokens the prefills took from a cache (radix or store: meta_info
cached_tokens) / prompt tokens; TTFT p50/p99 from the streams; bytes moved = PD transfer bytes
(prefill -> decode) + bytes put into and fetched from the store (pages x page bytes, every server).
Decodes keep their radix cache (--disaggregation-enable-decode-radix-cache) in every case.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import httpx

from kvpipe.bench.workload import Workload, WorkloadConfig, build_workload, parse_lengths
from kvpipe.harness.driver import run as drive
from kvpipe.harness.latency import completed_metrics, percentiles
from kvpipe.launch.start import start_pd_stack


@dataclass(frozen=True)
class Case:
    name: str
    prefills: int
    decodes: int
    policy: str | None  # sglang-router's policy on both sides (None: its default, one worker each)
    store: bool


CASES = (
    Case("1P1D", 1, 1, None, False),
    Case("2P2D round_robin", 2, 2, "round_robin", False),
    Case("2P2D round_robin + store", 2, 2, "round_robin", True),
    Case("2P2D cache_aware", 2, 2, "cache_aware", False),
    Case("2P2D cache_aware + store", 2, 2, "cache_aware", True),
)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload multiturn")
    g.add_argument("--conversations", type=int, default=8, help="conversations run side by side")
    g.add_argument("--turns", type=int, default=3, help="turns of each conversation")
    g.add_argument("--prefix-groups", type=int, default=2, help="shared prefixes (conversation c has c %% groups)")
    g.add_argument("--shared-prefix", type=int, default=256, help="tokens of each shared prefix")
    g.add_argument("--first-turn", type=int, default=320, help="prompt tokens of a conversation's first turn")
    g.add_argument("--turn-len", type=int, default=64, help="new tokens of each later turn")
    g.add_argument("--new-tokens", type=int, default=8, help="output tokens of every turn")
    g.add_argument("--concurrency", type=int, default=4, help="max requests in flight")


def workload(args: argparse.Namespace, vocab: int) -> Workload:
    return build_workload(
        WorkloadConfig(
            prompt_lens=parse_lengths(args.first_turn),
            output_lens=parse_lengths(args.new_tokens),
            num_requests=args.conversations * args.turns,
            vocab_size=vocab,
            num_prefix_groups=args.prefix_groups,
            prefix_len=args.shared_prefix,
            token_id_low=3,
            num_turns=args.turns,
            turn_len=args.turn_len,
        )
    )


def _internal(url: str) -> dict[str, Any]:
    return httpx.get(url + "/server_info", timeout=30.0).json()["internal_states"][0]


def _bytes_moved(prefills: list[dict[str, Any]], servers: list[dict[str, Any]]) -> dict[str, int]:
    pd = sum(int(s.get("disaggregation", {}).get("bytes_written", 0)) for s in prefills)
    put = fetched = 0
    for s in servers:
        tier = s.get("kv_store")
        if tier is None:
            continue
        page = int(s["kv_cache_bytes"]) // int(s["total_pages"])  # one page of every layer
        put += page * int(tier["pages_put"])
        fetched += page * int(tier["pages_fetched"])
    return {
        "pd_transfer_bytes": pd,
        "store_put_bytes": put,
        "store_fetched_bytes": fetched,
        "total": pd + put + fetched,
    }


def run_case(case: Case, wl: Workload, model: str, server_args: list[str], tier: list[str], log_dir: str, conc: int):
    slug = case.name.replace(" ", "_").replace("+", "store").replace("__", "_")
    with start_pd_stack(
        model,
        server_args=[*server_args, *(tier if case.store else [])],
        decode_args=["--disaggregation-enable-decode-radix-cache"],
        log_dir=os.path.join(log_dir, slug),
        timeout_s=600.0,
        prefills=case.prefills,
        decodes=case.decodes,
        prefill_policy=case.policy,
        decode_policy=case.policy,
    ) as stack:
        res = drive(stack.router_url, wl.requests, conc, deadline_s=600.0, progress=False, desc=case.name)
        prefills = [_internal(u) for u in stack.prefill_urls]
        decodes = [_internal(u) for u in stack.decode_urls]
    done = [o for o in res.outcomes if o.ok]
    prompt = sum(o.prompt_len for o in done)
    cached = sum(o.cached_tokens or 0 for o in done)
    ttft = percentiles([m.ttft_s * 1e3 for m in completed_metrics(res.outcomes)], (50, 99))
    return {
        "case": case.name,
        "requests": len(res.outcomes),
        "failed": len(res.outcomes) - len(done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_ms": ttft[50],
        "ttft_p99_ms": ttft[99],
        "bytes": _bytes_moved(prefills, [*prefills, *decodes]),
        "duration_s": res.duration_s,
        "store": [s.get("kv_store") for s in [*prefills, *decodes]] if case.store else None,
    }


def run_routing(args: argparse.Namespace, extra: list[str], model: str, vocab: int, log_dir: str) -> dict[str, Any]:
    wl = workload(args, vocab)
    server_args = ["--page-size", str(args.page_size), "--max-total-tokens", str(args.max_total_tokens), *extra]
    tier = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    tier += ["--hicache-mooncake-global-segment-size", args.segment_size, "--hicache-store-fetch-timeout", "5"]
    rows = []
    for case in CASES:
        row = run_case(case, wl, model, server_args, tier, log_dir, args.concurrency)
        rows.append(row)
        if not args.json:
            print(format_row(row), flush=True)
    single = rows[0]["hit_rate"] or 0.0
    best = next(r for r in rows if r["case"] == "2P2D cache_aware + store")["hit_rate"] or 0.0
    return {
        "workload": {
            k: getattr(args, k)
            for k in (
                "conversations",
                "turns",
                "prefix_groups",
                "shared_prefix",
                "first_turn",
                "turn_len",
                "new_tokens",
                "concurrency",
            )
        },
        "cases": rows,
        "cache_aware_store_vs_single_hit_rate": best / single if single else None,
    }


def format_row(row: dict[str, Any]) -> str:
    b = row["bytes"]

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    return (
        f"{row['case']:<26} hit rate {num(row['hit_rate'], '.3f')}  TTFT p50 {num(row['ttft_p50_ms'], '.0f')} ms "
        f"p99 {num(row['ttft_p99_ms'], '.0f')} ms  moved {b['total'] / 1e6:.1f} MB "
        f"(PD {b['pd_transfer_bytes'] / 1e6:.1f}, "
        f"store put {b['store_put_bytes'] / 1e6:.1f}, fetched {b['store_fetched_bytes'] / 1e6:.1f})"
        f"  failed {row['failed']}"
    )
