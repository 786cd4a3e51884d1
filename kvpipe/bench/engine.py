"""`kvpipe bench engine`: prefill and decode throughput of the offline Engine on this machine.

Everything runs through the engine's own step loop (Engine.add_request + Engine.step), timed
with time.perf_counter around the steps (and time.process_time: CPU seconds per wall second
show how much of its cores the benchmark really had on a shared machine; TP children excluded):
- prefill: a batch of random prompts (batch 1 and --prefill-batch) with max_new_tokens=1; the
  wall time from the first step until every request finished (their prefill, first-token
  sampling included; chunked prefill may take several steps).
- decode: --batch-sizes requests with --decode-context prompt tokens each are prefilled
  (untimed), then --decode-warmup-steps untimed and --output-len timed decode steps that each
  advance all of them (timed one by one). Every repeat prefills fresh requests, so each repeat
  decodes against the same context.
Each prefill point runs --warmup unmeasured times first; figures are medians over --repeat.

--compare-hf runs HF transformers on the same checkpoint in the same process (bench/hf_reference.py),
repeat by repeat alternating with the engine so load drift on a shared machine hits both alike,
and reports kvpipe/HF prefill time and kvpipe/HF decode throughput per point.

--compare-llamacpp does the same with llama.cpp (bench/llamacpp_reference.py, the `bench` extra)
on the same GGUF and thread count: batch-1 prefill points and batch-1 decode, per llama.cpp type
(--llamacpp-types; default the type matching --quantization: F32, Q8_0 or Q4_1), as
kvpipe/llama.cpp time ratios. --quantization none,w8a16,w4a16 runs one engine per mode, one after
the other, each against its own llama.cpp peer.

Example: kvpipe bench engine --preset bench --prompt-lens 256,1024,2048 --batch-sizes 1,8,32 --json
         kvpipe bench engine --preset bench --prompt-lens 256,1024,2048,4096 --batch-sizes 1,8,32 --compare-hf
         kvpipe bench engine --model-path <gguf> --prompt-lens 512 --batch-sizes 1 --compare-llamacpp \
             --quantization none,w8a16,w4a16
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from kvpipe.bench.engine_stats import (
    DecodePoint,
    PrefillPoint,
    compare_decode,
    compare_llamacpp_decode,
    compare_llamacpp_prefill,
    compare_prefill,
    cpu_per_wall,
    decode_max_new_tokens,
    decode_points,
    format_table,
    kv_tokens_needed,
    parse_int_list,
    prefill_points,
    summarize_decode,
    summarize_prefill,
)
from kvpipe.bench.hf_reference import HFReference
from kvpipe.bench.llamacpp_reference import LlamaCppReference, format_llamacpp, llamacpp_kinds, references
from kvpipe.bench.machine import cpu_name
from kvpipe.bench.spec_decode import WORKLOADS, format_spec
from kvpipe.bench.spec_decode import compare as compare_speculative
from kvpipe.config import (
    DECODE_FUSED_LAYER_MODES,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    CacheConfig,
    ConfigError,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import FinishReason, Req, SamplingParams
from kvpipe.model.checkpoint.gguf.reader import find_gguf
from kvpipe.model.checkpoint.loader import check_checkpoint
from kvpipe.model.presets import default_model_dir

STEP_LIMIT = 100_000  # no run of a point takes more engine steps than this


def add_args(p: argparse.ArgumentParser) -> None:
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model-path", default=None, help="local HF checkpoint directory or .gguf file (default: --preset)")
    m.add_argument("--preset", default=None, choices=["tiny", "bench"], help="built-in preset (default: bench)")
    p.add_argument("--prompt-lens", default="256,1024,2048", help="prefill prompt lengths in tokens")
    p.add_argument("--prefill-batch", type=int, default=4, help="the batched prefill point (besides batch 1)")
    p.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes")
    p.add_argument("--decode-context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--output-len", type=int, default=64, help="timed decode steps per repeat")
    p.add_argument(
        "--decode-warmup-steps",
        type=int,
        default=4,
        help="untimed full-batch decode steps before the timed ones, every repeat",
    )
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="tensor parallel ranks")
    p.add_argument("--dtype", default="auto", choices=list(MODEL_DTYPES), help="weights and activations")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV pool dtype; comma-separated: one engine per dtype, one after the other in this run "
        f"(each of {', '.join(KV_CACHE_DTYPES)})",
    )
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="max prompt tokens per prefill step")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="token budget of one prefill batch")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per TP rank (default: as a server's, the cores of the CPU affinity split among the ranks)",
    )
    p.add_argument("--repeat", type=int, default=3, help="measured runs per point (medians are reported)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs per prefill point first")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run HF transformers on the same checkpoint, alternating with the engine repeat by "
        "repeat, and report kvpipe/HF ratios (needs the transformers package)",
    )
    p.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=list(SPECULATIVE_ALGORITHMS),
        default=None,
        help="also compare decode tokens/s with and without speculative decoding on an editing "
        "workload (bench/spec_decode.py); --skip-prefill --skip-decode runs only that",
    )
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="tokens verified per step")
    p.add_argument("--speculative-draft-model-path", default=None, help="STANDALONE: the draft model's checkpoint")
    p.add_argument("--spec-output-len", type=int, default=160, help="max new tokens of the speculative workload")
    p.add_argument("--spec-batch", type=int, default=1, help="requests of the speculative workload run together")
    p.add_argument(
        "--spec-workload",
        choices=list(WORKLOADS),
        default="edit",
        help="edit: a chat turn asking to repeat a paragraph with its typos fixed; code-edit: one asking to rename "
        "identifiers in a Python module; chat: a free-form question (these three need a chat template); "
        "repeat: prompts repeating a random unit of tokens",
    )
    p.add_argument(
        "--quantization",
        default="none",
        help="weight-only quantization; comma-separated: one engine per mode, one after the other in "
        f"this run (each of none, {', '.join(QUANTIZATIONS)})",
    )
    p.add_argument(
        "--decode-fused-layer",
        default=ServerConfig.decode_fused_layer,
        help="a decode step's layers as one C++ call each; comma-separated: one engine per mode, one "
        f"after the other in this run (each of {', '.join(DECODE_FUSED_LAYER_MODES)})",
    )
    p.add_argument(
        "--compare-llamacpp",
        action="store_true",
        help="also run llama.cpp (llama-cpp-python, the bench extra) on the same GGUF with the same "
        "threads, alternating with the engine repeat by repeat, at batch 1: kvpipe/llama.cpp time ratios",
    )
    p.add_argument(
        "--llamacpp-types",
        default=None,
        help="llama.cpp GGUF types compared with every engine (comma-separated: F32, F16, Q8_0, Q4_0, Q4_1; "
        "converted from the model's GGUF with llama.cpp's quantizer); default: F32 for --quantization none, "
        "Q8_0 for w8a16, Q4_1 for w4a16",
    )
    p.add_argument(
        "--llamacpp-dir",
        default=None,
        help="where converted GGUFs are written and reused (default: a temporary directory of this run)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check(args: argparse.Namespace) -> None:
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


class EngineBench:
    """Drives one Engine through the benchmark points; holds the prompt RNG and rid counter."""

    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.vocab = engine.model_config.vocab_size
        self.rng = np.random.default_rng(seed)
        self._rids = itertools.count()

    def _add(self, n: int, prompt_len: int, max_new_tokens: int) -> list[Any]:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        reqs = []
        for _ in range(n):
            ids = self.rng.integers(0, self.vocab, size=prompt_len).tolist()
            req = Req(f"bench-{next(self._rids)}", ids, params)
            self.engine.add_request(req)
            reqs.append(req)
        return reqs

    def _fail_if_aborted(self, reqs: list[Any]) -> None:
        bad = [r for r in reqs if r.finish_reason is FinishReason.ABORT]
        if bad:
            raise RuntimeError(f"benchmark request {bad[0].rid} was aborted: {bad[0].finish_detail}")

    def prefill_once(self, point: PrefillPoint) -> tuple[float, int, float]:
        """Seconds to prefill `point.batch` prompts together, the engine steps it took, and the
        process CPU seconds per wall second meanwhile."""
        reqs = self._add(point.batch, point.prompt_len, 1)
        steps, c0, t0 = 0, time.process_time(), time.perf_counter()
        while not all(r.finished for r in reqs):
            self.engine.step()
            steps += 1
            if steps > STEP_LIMIT:
                raise RuntimeError("prefill did not finish")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        self._fail_if_aborted(reqs)
        return elapsed, steps, cpu_per_wall(cpu, elapsed)

    def decode_once(self, point: DecodePoint, budget: int) -> tuple[list[float], float]:
        """Step times (seconds) of `point.steps` decode steps that each advance the full batch,
        after `point.warmup_steps` such steps left untimed; and their CPU seconds per wall second."""
        reqs = self._add(point.batch, point.context, decode_max_new_tokens(point, budget))
        times: list[float] = []
        cpu: list[float] = []
        want = point.warmup_steps + point.steps
        try:
            for _ in range(STEP_LIMIT):
                if len(times) == want or any(r.finished for r in reqs):
                    break
                s = self.engine.stats()
                full = s["num_decoding"] == point.batch and s["num_prefilling"] == 0 and s["num_waiting"] == 0
                before = [len(r.output_ids) for r in reqs]
                c0, t0 = time.process_time(), time.perf_counter()
                self.engine.step()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                # timed only if it was a decode step of the whole batch (every request got 1 token)
                if full and all(len(r.output_ids) == b + 1 for r, b in zip(reqs, before)):
                    times.append(dt)
                    cpu.append(dc)
            self._fail_if_aborted(reqs)
            if len(times) < want:
                raise RuntimeError(f"only {len(times)} of {want} full-batch decode steps ran")
        finally:
            for r in reqs:
                self.engine.abort(r.rid)
            self.engine.step()  # drains the aborts: pages go back before the next point
        if self.engine.has_work():
            raise RuntimeError("benchmark requests left in the engine after a decode run")
        timed = times[point.warmup_steps :]
        return timed, cpu_per_wall(sum(cpu[point.warmup_steps :]), sum(timed))


def _llamacpp(
    args: argparse.Namespace,
    model_path: str,
    quantization: str | None,
    threads: int,
    ppoints: list[PrefillPoint],
    dpoints: list[DecodePoint],
) -> list[LlamaCppReference]:
    """The llama.cpp references of --compare-llamacpp (none without it), with a context and a batch
    large enough for every point of this run."""
    if not getattr(args, "compare_llamacpp", False):
        return []
    gguf = find_gguf(model_path)
    if gguf is None:
        raise SystemExit("kvpipe bench engine: --compare-llamacpp needs a GGUF checkpoint (--model-path <file>.gguf)")
    longest = max([p.prompt_len for p in ppoints] + [1])
    n_ctx = max([longest] + [d.context + d.warmup_steps + d.steps for d in dpoints]) + 64
    kinds = llamacpp_kinds(args.llamacpp_types, quantization)
    return references(gguf, kinds, Path(args.llamacpp_dir), args.seed, threads, n_ctx, max(longest, 512))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    if args.model_path:
        model_path, model = args.model_path, args.model_path
    else:
        model = f"preset:{args.preset or 'bench'}"
        model_path = str(default_model_dir(args.preset or "bench"))
    budget = prefill_budget(args)
    quantization = None if args.quantization in (None, "none") else args.quantization
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
    # KV pool sized to the largest point (a page of slack per request), not the 64K-token default
    max_batch = max([p.batch for p in ppoints] + [d.batch for d in dpoints] + [1])
    kv_tokens = kv_tokens_needed(ppoints, dpoints, budget) + max_batch * args.page_size
    cfg = ServerConfig(
        model_path=model_path,
        tp_size=args.tp_size,
        seed=args.seed,
        log_level="warning",
        cpu_threads=args.threads * args.tp_size if args.threads else None,
        dtype=args.dtype,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=kv_tokens, kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_running_requests=max(64, max_batch),
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
        ),
        quantization=quantization,
        decode_fused_layer=args.decode_fused_layer,
    )
    try:  # a bad checkpoint: one line, not a traceback from the engine's load
        check_checkpoint(model_path, quantization=quantization)
    except ConfigError as e:
        raise SystemExit(f"kvpipe bench engine: {e}") from None
    threads = server_cpu_threads(cfg)  # as a server plans them: every TP rank gets per_rank
    apply_cpu_threads(threads)  # rank 0 runs here; the other ranks apply the same plan themselves
    load_start = list(os.getloadavg())
    llama = _llamacpp(args, model_path, quantization, threads.total, ppoints, dpoints)  # refused before the engine
    engine = Engine(cfg)
    hf = None
    if args.compare_hf:
        hf = HFReference(model_path, args.seed, threads.total)  # the threads all engine ranks share
    runs = args.warmup + args.repeat
    bar = tqdm(
        total=len(ppoints) * runs + len(dpoints) * args.repeat,
        desc="bench engine",
        file=sys.stderr,
        disable=args.no_progress,
        leave=False,
    )
    prefill, decode = [], []
    try:
        bench = EngineBench(engine, args.seed)
        for p in ppoints:
            bar.set_postfix_str(f"prefill {p.prompt_len}x{p.batch}")
            samples, hf_samples = [], []
            lc_samples: dict[str, list[tuple[float, float]]] = {r.kind: [] for r in llama}
            for i in range(runs):
                res = bench.prefill_once(p)
                hf_res = hf.prefill_once(p) if hf else None
                lc_res = [(r.kind, r.prefill_once(p)) for r in llama]
                if i >= args.warmup:
                    samples.append(res)
                    if hf_res:
                        hf_samples.append(hf_res)
                    for kind, x in lc_res:
                        if x is not None:
                            lc_samples[kind].append(x)
                bar.update()
            row = summarize_prefill(p, [x[0] for x in samples], [x[1] for x in samples], [x[2] for x in samples])
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
            if lc_rows:
                row = compare_llamacpp_prefill(row, lc_rows)
            prefill.append(row)
        for d in dpoints:
            bar.set_postfix_str(f"decode batch {d.batch}")
            reps, hf_reps = [], []
            lc_reps: dict[str, list[tuple[list[float], float]]] = {r.kind: [] for r in llama}
            for _ in range(args.repeat):
                reps.append(bench.decode_once(d, budget))
                if hf:
                    hf_reps.append(hf.decode_once(d))
                for r in llama:
                    steps = r.decode_once(d)
                    if steps is not None:
                        lc_reps[r.kind].append(steps)
                bar.update()
            row = summarize_decode(d, [r[0] for r in reps], [r[1] for r in reps])
            if hf:
                hf_row = summarize_decode(d, [r[0] for r in hf_reps], [cpu_per_wall(c, sum(t)) for t, c in hf_reps])
                row = compare_decode(row, hf_row)
            lc_drows = {
                k: summarize_decode(d, [t for t, _ in xs], [cpu_per_wall(c, sum(t)) for t, c in xs])
                for k, xs in lc_reps.items()
                if xs
            }
            if lc_drows:
                row = compare_llamacpp_decode(row, lc_drows)
            decode.append(row)
        kv_bytes = engine.stats()["kv_cache_bytes"]
    finally:
        bar.close()
        engine.shutdown()
        for r in llama:
            r.close()
    speculative = None
    if args.speculative_algorithm:
        try:
            spec = SpeculativeConfig(
                args.speculative_algorithm,
                num_draft_tokens=args.speculative_num_draft_tokens,
                draft_model_path=args.speculative_draft_model_path,
            )
        except ConfigError as e:
            raise SystemExit(f"kvpipe bench engine: {e}") from None
        speculative = compare_speculative(
            cfg, spec, args.spec_workload, args.spec_batch, args.spec_output_len, args.repeat, args.seed
        )
    mc = engine.model_config
    return {
        "config": {
            "model": model,
            "model_path": model_path,
            "layers": mc.num_layers,
            "hidden": mc.hidden_size,
            "heads": mc.num_heads,
            "kv_heads": mc.num_kv_heads,
            "dtype": mc.dtype,
            "run_dtype": args.dtype,
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
            "kv_cache_tokens": kv_tokens,
            "kv_cache_bytes": kv_bytes,
            "seed": args.seed,
            "compare_hf": None if hf is None else {"attn_implementation": hf.attn, "threads": hf.threads},
            "quantization": quantization,
            "decode_fused_layer": args.decode_fused_layer,
            "compare_llamacpp": None
            if not llama
            else {
                "version": llama[0].version,
                "threads": llama[0].threads,
                "files": {r.kind: str(r.path) for r in llama},
            },
        },
        "machine": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            # the 1/5/15-minute load averages before and after: a shared machine is noisy
            "load_avg_start": load_start,
            "load_avg_end": list(os.getloadavg()),
        },
        "prefill": prefill,
        "decode": decode,
        **({"speculative": speculative} if speculative is not None else {}),
    }


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    kv_dtypes = [d.strip() for d in str(args.kv_cache_dtype).split(",") if d.strip()]
    bad = [d for d in kv_dtypes if d not in KV_CACHE_DTYPES]
    if bad or not kv_dtypes:
        raise SystemExit(f"kvpipe bench engine: --kv-cache-dtype takes {', '.join(KV_CACHE_DTYPES)}, got {bad}")
    quants = [q.strip() for q in str(args.quantization).split(",") if q.strip()]
    badq = [q for q in quants if q != "none" and q not in QUANTIZATIONS]
    if badq or not quants:
        raise SystemExit(f"kvpipe bench engine: --quantization takes none, {', '.join(QUANTIZATIONS)}, got {badq}")
    fused = [f.strip() for f in str(args.decode_fused_layer).split(",") if f.strip()]
    badf = [f for f in fused if f not in DECODE_FUSED_LAYER_MODES]
    if badf or not fused:
        raise SystemExit(
            f"kvpipe bench engine: --decode-fused-layer takes {', '.join(DECODE_FUSED_LAYER_MODES)}, got {badf}"
        )
    reports = []
    with ExitStack() as stack:
        workdir = args.llamacpp_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpipe-llamacpp-"))
        for kv in kv_dtypes:  # one engine at a time: their pools never share the memory
            for q in quants:
                for f in fused:
                    over = {"kv_cache_dtype": kv, "quantization": q, "decode_fused_layer": f, "llamacpp_dir": workdir}
                    report = run_bench(argparse.Namespace(**{**vars(args), **over}))
                    reports.append(report)
                    if not args.json:
                        print(format_table(report), flush=True)
                        if report["config"].get("compare_llamacpp"):
                            print(format_llamacpp(report), flush=True)
                        if "speculative" in report:
                            print(format_spec(report["speculative"]), flush=True)
    result = reports[0] if len(reports) == 1 else {"runs": reports}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench engine", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
