"""One run of `kvpipe bench engine`: one Engine (one KV dtype, quantization and fused-layer mode)
through every prefill and decode point, with its HF and llama.cpp references alternating repeat
by repeat, and the report (the figures: stats.py; the timing: timing.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvpipe.bench.engine.floor import peaks_section
from kvpipe.bench.engine.hf_reference import HFReference
from kvpipe.bench.engine.llamacpp_reference import LlamaCppReference, llamacpp_kinds, references
from kvpipe.bench.engine.peaks import compute_dtype, measure_peaks, with_floors
from kvpipe.bench.engine.spec_decode import compare as compare_speculative
from kvpipe.bench.engine.stats import (
    DecodePoint,
    PrefillPoint,
    compare_decode,
    compare_dtype_decode,
    compare_dtype_prefill,
    compare_llamacpp_decode,
    compare_llamacpp_prefill,
    compare_prefill,
    cpu_per_wall,
    decode_points,
    kv_tokens_needed,
    parse_int_list,
    prefill_points,
    summarize_decode,
    summarize_prefill,
)
from kvpipe.bench.engine.timing import EngineBench
from kvpipe.config import CacheConfig, ConfigError, SchedulerConfig, ServerConfig, SpeculativeConfig
from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads
from kvpipe.engine.engine import Engine
from kvpipe.harness.machine import cpu_name
from kvpipe.model.checkpoint.gguf.reader import find_gguf
from kvpipe.model.checkpoint.loader import check_checkpoint
from kvpipe.model.presets import default_model_dir


def check_args(args: argparse.Namespace) -> None:
    for name in (
        "prefill_batch",
        "decode_context",
        "output_len",
        "tp_size",
        "page_size",
        "max_prefill_tokens",
        "repeat",
        "spec_output_len",
        "spec_batch",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvpipe bench engine: --{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or args.decode_warmup_steps < 0 or (args.threads is not None and args.threads < 1):
        raise SystemExit("kvpipe bench engine: --warmup and --decode-warmup-steps must be >= 0, --threads positive")


def prefill_budget(args: argparse.Namespace) -> int:
    """Prompt tokens one prefill step takes at most (the scheduler's rule)."""
    if args.chunked_prefill_size > 0:
        return min(args.max_prefill_tokens, args.chunked_prefill_size)
    return args.max_prefill_tokens


@dataclass(frozen=True)
class BenchPlan:
    """What a run measures, from its flags: the model, the points and the KV pool they need."""

    model: str  # as the report names it: the path given, or preset:NAME
    model_path: str
    quantization: str | None
    budget: int  # prompt tokens per prefill step
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    kv_tokens: int

    @property
    def max_batch(self) -> int:
        return _max_batch(self.prefill, self.decode)


def _max_batch(prefill: list[PrefillPoint], decode: list[DecodePoint]) -> int:
    return max([p.batch for p in prefill] + [d.batch for d in decode] + [1])


def plan_of(args: argparse.Namespace) -> BenchPlan:
    if args.model_path:
        model_path, model = args.model_path, args.model_path
    else:
        model = f"preset:{args.preset or 'bench'}"
        model_path = str(default_model_dir(args.preset or "bench"))
    budget = prefill_budget(args)
    ppoints = (
        []
        if args.skip_prefill
        else prefill_points(parse_int_list(args.prompt_lens, "--prompt-lens"), [args.prefill_batch])
    )
    dpoints = (
        []
        if args.skip_decode
        else decode_points(
            parse_int_list(args.batch_sizes, "--batch-sizes"),
            args.decode_context,
            args.output_len,
            args.decode_warmup_steps,
        )
    )
    quantization = None if args.quantization in (None, "none") else args.quantization
    # KV pool sized to the largest point (a page of slack per request), not the 64K-token default
    kv_tokens = kv_tokens_needed(ppoints, dpoints, budget) + _max_batch(ppoints, dpoints) * args.page_size
    return BenchPlan(model, model_path, quantization, budget, ppoints, dpoints, kv_tokens)


def server_config(args: argparse.Namespace, plan: BenchPlan) -> ServerConfig:
    return ServerConfig(
        model_path=plan.model_path,
        tp_size=args.tp_size,
        seed=args.seed,
        log_level="warning",
        cpu_threads=args.threads * args.tp_size if args.threads else None,
        dtype=args.dtype,
        cache=CacheConfig(
            page_size=args.page_size, max_total_tokens=plan.kv_tokens, kv_cache_dtype=args.kv_cache_dtype
        ),
        scheduler=SchedulerConfig(
            max_running_requests=max(64, plan.max_batch),
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
        ),
        quantization=plan.quantization,
        decode_fused_layer=args.decode_fused_layer,
    )


def _llamacpp(args: argparse.Namespace, plan: BenchPlan, threads: int) -> list[LlamaCppReference]:
    """The llama.cpp references of --compare-llamacpp (none without it), with a context and a batch
    large enough for every point of this run."""
    if not getattr(args, "compare_llamacpp", False):
        return []
    gguf = find_gguf(plan.model_path)
    if gguf is None:
        raise SystemExit("kvpipe bench engine: --compare-llamacpp needs a GGUF checkpoint (--model-path <file>.gguf)")
    longest = max([p.prompt_len for p in plan.prefill] + [1])
    n_ctx = max([longest] + [d.context + d.warmup_steps + d.steps for d in plan.decode]) + 64
    kinds = llamacpp_kinds(args.llamacpp_types, plan.quantization)
    return references(gguf, kinds, Path(args.llamacpp_dir), args.seed, threads, n_ctx, max(longest, 512))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    plan = plan_of(args)
    cfg = server_config(args, plan)
    try:  # a bad checkpoint: one line, not a traceback from the engine's load
        check_checkpoint(plan.model_path, quantization=plan.quantization)
    except ConfigError as e:
        raise SystemExit(f"kvpipe bench engine: {e}") from None
    threads = server_cpu_threads(cfg)  # as a server plans them: every TP rank gets per_rank
    apply_cpu_threads(threads)  # rank 0 runs here; the other ranks apply the same plan themselves
    load_start = list(os.getloadavg())
    llama = _llamacpp(args, plan, threads.total)  # refused before the engine
    engine = Engine(cfg)
    other = None
    if args.compare_dtype:  # a second engine in another --dtype, alternating with the first
        other = Engine(dataclasses.replace(cfg, dtype=args.compare_dtype))
    hf = None
    if args.compare_hf:
        hf = HFReference(plan.model_path, args.seed, threads.total)  # the threads all engine ranks share
    runs = args.warmup + args.repeat
    bar = tqdm(
        total=len(plan.prefill) * runs + len(plan.decode) * args.repeat,
        desc="bench engine",
        file=sys.stderr,
        disable=args.no_progress,
        leave=False,
    )
    try:
        bench = EngineBench(engine, args.seed)
        pair = (bench, None if other is None else EngineBench(other, args.seed))
        dtype = compute_dtype(args, engine)
        peaks = measure_peaks(dtype)  # in this run, on its threads: the floors' rates
        prefill = [measure_prefill(args, pair, hf, llama, p, bar) for p in plan.prefill]
        decode = [measure_decode(args, pair, hf, llama, d, plan.budget, bar) for d in plan.decode]
        peaks = peaks.best(measure_peaks(dtype))  # again after the points: the better of two
        stats = engine.stats()
        kv_bytes = stats["kv_cache_bytes"]
        kv_dtype = stats["kv_cache_storage_dtype"]
        prefill, decode = with_floors(engine, plan.quantization, peaks, dtype, kv_dtype, prefill, decode)
    finally:
        bar.close()
        engine.shutdown()
        if other is not None:
            other.shutdown()
        for r in llama:
            r.close()
    speculative = _speculative(args, cfg)
    return {
        "config": _config_section(args, plan, engine, kv_bytes, hf, llama),
        "machine": _machine_section(load_start),
        "peaks": peaks_section(peaks),
        "prefill": prefill,
        "decode": decode,
        **({"speculative": speculative} if speculative is not None else {}),
    }


def measure_prefill(
    args: argparse.Namespace,
    pair: tuple[EngineBench, EngineBench | None],
    hf: HFReference | None,
    llama: list[LlamaCppReference],
    p: PrefillPoint,
    bar: tqdm,
) -> dict[str, Any]:
    """Point p's row: --warmup unmeasured then --repeat measured prefills, each followed by the
    same prefill on the --compare-dtype engine and every reference (load drift on a shared machine
    hits them all alike)."""
    bar.set_postfix_str(f"prefill {p.prompt_len}x{p.batch}")
    bench, other = pair
    samples, hf_samples, other_samples = [], [], []
    lc_samples: dict[str, list[tuple[float, float]]] = {r.kind: [] for r in llama}
    for i in range(args.warmup + args.repeat):
        res = bench.prefill_once(p)
        other_res = other.prefill_once(p) if other else None
        hf_res = hf.prefill_once(p) if hf else None
        lc_res = [(r.kind, r.prefill_once(p)) for r in llama]
        if i >= args.warmup:
            samples.append(res)
            if other_res:
                other_samples.append(other_res)
            if hf_res:
                hf_samples.append(hf_res)
            for kind, x in lc_res:
                if x is not None:
                    lc_samples[kind].append(x)
        bar.update()
    row = summarize_prefill(p, [x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
    if other_samples:
        other_row = summarize_prefill(p, *(list(x) for x in zip(*other_samples)))
        row = compare_dtype_prefill(row, other_row, args.compare_dtype)
    if hf:
        hf_row = summarize_prefill(
            p, [x[0] for x in hf_samples], [1] * len(hf_samples), [cpu_per_wall(c, t) for t, c in hf_samples]
        )
        row = compare_prefill(row, hf_row)
    lc_rows = {
        k: summarize_prefill(p, [t for t, _ in xs], [1] * len(xs), [cpu_per_wall(c, t) for t, c in xs])
        for k, xs in lc_samples.items()
        if xs
    }
    return compare_llamacpp_prefill(row, lc_rows) if lc_rows else row


def measure_decode(
    args: argparse.Namespace,
    pair: tuple[EngineBench, EngineBench | None],
    hf: HFReference | None,
    llama: list[LlamaCppReference],
    d: DecodePoint,
    budget: int,
    bar: tqdm,
) -> dict[str, Any]:
    """Point d's row: --repeat decode runs, each followed by the same run on the --compare-dtype
    engine and every reference."""
    bar.set_postfix_str(f"decode batch {d.batch}")
    bench, other = pair
    reps, hf_reps, other_reps = [], [], []
    lc_reps: dict[str, list[tuple[list[float], float]]] = {r.kind: [] for r in llama}
    for _ in range(args.repeat):
        reps.append(bench.decode_once(d, budget))
        if other:
            other_reps.append(other.decode_once(d, budget))
        if hf:
            hf_reps.append(hf.decode_once(d))
        for r in llama:
            steps = r.decode_once(d)
            if steps is not None:
                lc_reps[r.kind].append(steps)
        bar.update()
    row = summarize_decode(d, [r[0] for r in reps], [r[1] for r in reps])
    if other_reps:
        other_row = summarize_decode(d, [r[0] for r in other_reps], [r[1] for r in other_reps])
        row = compare_dtype_decode(row, other_row, args.compare_dtype)
    if hf:
        hf_row = summarize_decode(d, [r[0] for r in hf_reps], [cpu_per_wall(c, sum(t)) for t, c in hf_reps])
        row = compare_decode(row, hf_row)
    lc_drows = {
        k: summarize_decode(d, [t for t, _ in xs], [cpu_per_wall(c, sum(t)) for t, c in xs])
        for k, xs in lc_reps.items()
        if xs
    }
    return compare_llamacpp_decode(row, lc_drows) if lc_drows else row


def _speculative(args: argparse.Namespace, cfg: ServerConfig) -> dict[str, Any] | None:
    """--speculative-algorithm: decode with and without it on its own workload (None without)."""
    if not args.speculative_algorithm:
        return None
    try:
        spec = SpeculativeConfig(
            args.speculative_algorithm,
            num_draft_tokens=args.speculative_num_draft_tokens,
            draft_model_path=args.speculative_draft_model_path,
        )
    except ConfigError as e:
        raise SystemExit(f"kvpipe bench engine: {e}") from None
    return compare_speculative(
        cfg, spec, args.spec_workload, args.spec_batch, args.spec_output_len, args.repeat, args.seed
    )


def _config_section(
    args: argparse.Namespace,
    plan: BenchPlan,
    engine: Engine,
    kv_bytes: int,
    hf: HFReference | None,
    llama: list[LlamaCppReference],
) -> dict[str, Any]:
    mc = engine.model_config
    return {
        "model": plan.model,
        "model_path": plan.model_path,
        "layers": mc.num_layers,
        "hidden": mc.hidden_size,
        "heads": mc.num_heads,
        "kv_heads": mc.num_kv_heads,
        "dtype": mc.dtype,
        "run_dtype": args.dtype,
        "compare_dtype": args.compare_dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "tp_size": args.tp_size,
        "page_size": args.page_size,
        "chunked_prefill_size": args.chunked_prefill_size,
        "max_prefill_tokens": args.max_prefill_tokens,
        "decode_context": args.decode_context,
        "output_len": args.output_len,
        "decode_warmup_steps": args.decode_warmup_steps,
        "repeat": args.repeat,
        "warmup": args.warmup,
        "kv_cache_tokens": plan.kv_tokens,
        "kv_cache_bytes": kv_bytes,
        "seed": args.seed,
        "compare_hf": None if hf is None else {"attn_implementation": hf.attn, "threads": hf.threads},
        "quantization": plan.quantization,
        "decode_fused_layer": args.decode_fused_layer,
        "compare_llamacpp": None
        if not llama
        else {
            "version": llama[0].version,
            "threads": llama[0].threads,
            "files": {r.kind: str(r.path) for r in llama},
        },
    }


def _machine_section(load_start: list[float]) -> dict[str, Any]:
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # the 1/5/15-minute load averages before and after: a shared machine is noisy
        "load_avg_start": load_start,
        "load_avg_end": list(os.getloadavg()),
    }
