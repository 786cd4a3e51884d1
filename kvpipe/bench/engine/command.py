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

--compare-hf runs HF transformers on the same checkpoint in the same process (bench/engine/hf_reference.py),
repeat by repeat alternating with the engine so load drift on a shared machine hits both alike,
and reports kvpipe/HF prefill time and kvpipe/HF decode throughput per point.

--compare-dtype runs a second engine of the same model in another --dtype the same way (e.g. --dtype
bfloat16 --compare-dtype float32) and reports the time ratio per point.

Every point is also set against the hardware's floor measured in the same run (floor.py, peaks.py):
a decode step against (weight + KV bytes) / read bandwidth, a prefill against FLOPs / the matmul
peak of the dtype in use, as floor_ms and x_floor.

--compare-llamacpp does the same with llama.cpp (bench/engine/llamacpp_reference.py, the `bench` extra)
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
import json
import tempfile
from contextlib import ExitStack

from kvpipe.bench.engine.llamacpp_reference import format_llamacpp
from kvpipe.bench.engine.plot import plot_engine
from kvpipe.bench.engine.run import run_bench
from kvpipe.bench.engine.spec_decode import WORKLOADS, format_spec
from kvpipe.bench.engine.stats import format_table
from kvpipe.bench.output import add_output_args, write_outputs
from kvpipe.config import (
    DECODE_FUSED_LAYER_MODES,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    ServerConfig,
)


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
        "--compare-dtype",
        default=None,
        choices=[d for d in MODEL_DTYPES if d != "auto"],
        help="also run a second engine in this --dtype, alternating with the first repeat by repeat, and report "
        "the time ratio of the two per point (< 1: --dtype faster)",
    )
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
    p.add_argument("--skip-prefill", action="store_true", help="measure decode only")
    p.add_argument("--skip-decode", action="store_true", help="measure prefill only")
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run HF transformers on the same checkpoint, alternating with the engine repeat by "
        "repeat, and report kvpipe/HF ratios (needs the transformers package)",
    )
    _add_spec_args(p)
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
    add_output_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    """The speculative-decoding comparison (bench/engine/spec_decode.py)."""
    p.add_argument(
        "--speculative-algorithm",
        type=str.upper,
        choices=list(SPECULATIVE_ALGORITHMS),
        default=None,
        help="also compare decode tokens/s with and without speculative decoding on an editing "
        "workload (bench/engine/spec_decode.py); --skip-prefill --skip-decode runs only that",
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
    write_outputs(result, args, lambda res, path: plot_engine(reports, path))
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench engine", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
