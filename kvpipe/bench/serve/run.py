"""One measured run of `kvpipe bench serve`: the workload from the flags, unmeasured warm-up
requests then the measured ones, and the result written out (JSON, plot, table)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvpipe.bench.serve.chat_text import ChatText
from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths
from kvpipe.harness import driver
from kvpipe.harness.latency import first_errors, summarize
from kvpipe.harness.outcome import Outcome
from kvpipe.harness.probe import model_config
from kvpipe.harness.request import Api

# how a request is run where the server is reachable: directly, or by Endpoint.call (a thread
# inside a testbed namespace)
Call = Callable[..., Any]


def direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def vocab_size(args: argparse.Namespace, model_path: str | None, text: ChatText | None = None) -> int:
    """--vocab-size, else the model's config.json vocab_size; with chat prompts at most the
    tokenizer's (a checkpoint's embedding may be padded past the ids its tokenizer decodes)."""
    if args.vocab_size:
        n = int(args.vocab_size)
    else:
        cfg = model_config(model_path) if model_path else None
        if not cfg or not isinstance(cfg.get("vocab_size"), int):
            raise SystemExit(f"kvpipe bench serve: cannot read vocab_size from {model_path!r}; pass --vocab-size")
        n = int(cfg["vocab_size"])
    return min(n, text.vocab_size) if text is not None else n


def workload_config(args: argparse.Namespace, vocab: int, prompt_lens: str | int) -> WorkloadConfig:
    try:
        return WorkloadConfig(
            parse_lengths(prompt_lens, "--prompt-lens"),
            parse_lengths(args.output_lens, "--output-lens"),
            args.num_requests,
            vocab,
            args.request_rate,
            args.seed,
            args.num_prefix_groups,
            args.prefix_len,
            args.token_id_low,
            args.num_turns,
            args.turn_len,
            Api(args.api),
        )
    except ValueError as e:
        raise SystemExit(f"kvpipe bench serve: {e}") from None


def warmup_config(cfg: WorkloadConfig, args: argparse.Namespace) -> WorkloadConfig:
    """Unmeasured single-turn requests with other prompts (other prefixes too)."""
    return replace(
        cfg, num_requests=args.warmup_requests, seed=cfg.seed + 1_000_003, request_rate=math.inf, num_turns=1
    )


def warm_up(
    call: Call,
    url: str,
    cfg: WorkloadConfig,
    args: argparse.Namespace,
    desc: str,
    progress: bool,
    text: ChatText | None = None,
) -> None:
    if args.warmup_requests > 0:
        warm = build_workload(warmup_config(cfg, args), text).requests
        call(driver.run, url, warm, args.concurrency, args.timeout, progress, desc)


def summary_of(outcomes: Sequence[Outcome], duration_s: float) -> dict[str, Any]:
    """latency.summarize, with a few errors when requests failed."""
    summary: dict[str, Any] = summarize(outcomes, duration_s)
    errors = first_errors(outcomes)
    if errors:
        summary["errors"] = errors
    return summary


def measure(
    call: Call,
    url: str,
    cfg: WorkloadConfig,
    args: argparse.Namespace,
    desc: str,
    after_warmup: Callable[[], None] | None = None,
    text: ChatText | None = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Warm-up requests (other prompts), `after_warmup()`, then the measured run; returns
    (summary, outcomes). `text`: the tokenizer that turns a chat workload's ids into text."""
    warm_up(call, url, cfg, args, f"{desc} warmup", not args.no_progress, text)
    if after_warmup is not None:
        after_warmup()
    res = call(
        driver.run, url, build_workload(cfg, text).requests, args.concurrency, args.timeout, not args.no_progress, desc
    )
    summary = summary_of(res.outcomes, res.duration_s)
    if "errors" in summary:
        print(f"kvpipe bench serve: {desc}: {summary['failed']} failed, e.g. {summary['errors'][0]}", file=sys.stderr)
    return summary, res.outcomes


def config_dict(cfg: WorkloadConfig, args: argparse.Namespace) -> dict[str, Any]:
    d = asdict(cfg)
    d["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
    d["prompt_lens"], d["output_lens"] = cfg.prompt_lens.describe(), cfg.output_lens.describe()
    d["api"] = cfg.api.value  # chat: prompt_lens are the user text's ids; the summaries count the rendered prompts
    return {**d, "concurrency": args.concurrency, "warmup_requests": args.warmup_requests}


def emit(
    result: Mapping[str, Any], args: argparse.Namespace, plot: Callable[[str], Any], table: str | None = None
) -> None:
    """The result as JSON (--json: one line on stdout; --out: a file) and a plot; without --json
    `table` (else the indented JSON) is printed."""
    text = json.dumps(result, indent=None if args.json else 2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot_path = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot_path:
        plot(plot_path)
    if args.json:
        print(text)
        return
    if table is not None:
        print(table)
    if table is None and not args.out:
        print(text)
    elif args.out:
        print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path else ""))
