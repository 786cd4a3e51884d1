"""`kvpipe generate`: one-shot generation without a server (text, or one JSON object per prompt).

The engine (torch) is imported in `run`: `--help` only builds the parser."""

from __future__ import annotations

import argparse
import json

from kvpipe.commands.flags import (
    add_server_args,
    check_model,
    require_positive,
    server_config_from_args,
    setup_logging,
)
from kvpipe.engine.cpu_threads import apply_cpu_threads, server_cpu_threads


def add_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    p.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens up to this mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, output_ids, ...)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from kvpipe.engine.engine import Engine
    from kvpipe.engine.request import SamplingParams

    require_positive("--max-new-tokens", args.max_new_tokens)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("kvpipe: --temperature must be >= 0 and --top-p in (0, 1]")
    cfg = server_config_from_args(args)
    setup_logging("warning" if args.log_level == "info" else args.log_level)
    check_model(cfg)
    apply_cpu_threads(server_cpu_threads(cfg))  # as a server would, before the model loads
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    engine = Engine(cfg)
    try:
        results = engine.generate(args.prompt, params)
    finally:
        engine.shutdown()
    for prompt, r in zip(args.prompt, results):
        if args.json:
            print(json.dumps({"prompt": prompt, **r}, ensure_ascii=False))
        else:
            print(r["text"])
    return 0
