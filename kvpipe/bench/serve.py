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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvpipe.bench.workload import WorkloadConfig, build_workload, parse_lengths, split_rounds


def add_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
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
        help="sweep: baseline, pipelined, pipelined-N (forced N groups), inproc (colocated)",
    )
    t.add_argument("--model-path", default=None, help="sweep: checkpoint directory (default: tiny preset)")
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
    t.add_argument("--log-dir", default=None, help="sweep: write server logs here (default: a new temp dir)")
    t.add_argument("--startup-timeout", type=float, default=300.0, help="sweep: seconds for a stack to start")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as one JSON object")
    o.add_argument("--out", default=None, help="write the JSON result to this file")
    o.add_argument("--plot", default=None, help="PNG plot path (default: --out with .png)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _vocab_size(args: argparse.Namespace, model_path: str | None) -> int:
    from kvpipe.bench.probe import model_config

    if args.vocab_size:
        return args.vocab_size
    cfg = model_config(model_path) if model_path else None
    if not cfg or not isinstance(cfg.get("vocab_size"), int):
        raise SystemExit(f"kvpipe bench serve: cannot read vocab_size from {model_path!r}; pass --vocab-size")
    return int(cfg["vocab_size"])


def _workload_config(args: argparse.Namespace, vocab: int, prompt_lens: str | int) -> WorkloadConfig:
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
        )
    except ValueError as e:
        raise SystemExit(f"kvpipe bench serve: {e}") from None


def _warmup_config(cfg: WorkloadConfig, args: argparse.Namespace) -> WorkloadConfig:
    """Unmeasured single-turn requests with other prompts (other prefixes too)."""
    return replace(
        cfg, num_requests=args.warmup_requests, seed=cfg.seed + 1_000_003, request_rate=math.inf, num_turns=1
    )


def _measure(
    call: Any, url: str, cfg: WorkloadConfig, args: argparse.Namespace, desc: str, after_warmup: Any = None
) -> tuple[dict, list]:
    """Warm-up requests (other prompts), `after_warmup()`, then the measured run; returns (summary, records)."""
    from kvpipe.bench.client import run_workload
    from kvpipe.bench.latency import first_errors, summarize

    progress = not args.no_progress
    if args.warmup_requests > 0:
        warm = _warmup_config(cfg, args)
        call(run_workload, url, build_workload(warm), args.concurrency, args.timeout, progress, f"{desc} warmup")
    if after_warmup is not None:
        after_warmup()
    res = call(run_workload, url, build_workload(cfg), args.concurrency, args.timeout, progress, desc)
    summary = summarize(res.records, res.duration_s)
    errors = first_errors(res.records)
    if errors:
        summary["errors"] = errors
        print(f"kvpipe bench serve: {desc}: {summary['failed']} failed, e.g. {errors[0]}", file=sys.stderr)
    return summary, res.records


def _config_dict(cfg: WorkloadConfig, args: argparse.Namespace) -> dict[str, Any]:
    d = asdict(cfg)
    d["request_rate"] = None if math.isinf(cfg.request_rate) else cfg.request_rate
    d["prompt_lens"], d["output_lens"] = cfg.prompt_lens.describe(), cfg.output_lens.describe()
    return {**d, "concurrency": args.concurrency, "warmup_requests": args.warmup_requests}


def _emit(result: Mapping[str, Any], args: argparse.Namespace, plot: Any, table: str | None = None) -> None:
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


def run_single(args: argparse.Namespace) -> int:
    from kvpipe.bench.plot import plot_run
    from kvpipe.bench.probe import server_model_path

    model_path = args.model_path or (None if args.vocab_size else server_model_path(args.url))
    cfg = _workload_config(args, _vocab_size(args, model_path), args.prompt_lens)
    summary, records = _measure(lambda f, *a: f(*a), args.url, cfg, args, "requests")
    result = {"url": args.url, "workload": _config_dict(cfg, args), "summary": summary}
    _emit(result, args, lambda path: plot_run(records, summary, path))
    return 0 if summary["completed"] else 1


def run_sweep_cmd(args: argparse.Namespace, compare: bool = False) -> int:
    """A sweep of --sweep-prompt-lens over --modes; `compare`: --prompt-lens over PD and colocated."""
    from kvpipe.bench.compare import COMPARE_MODES, compare_rows, compare_table
    from kvpipe.bench.plot import plot_modes, plot_sweep
    from kvpipe.bench.probe import (
        count_delta,
        model_config,
        read_num_groups,
        read_server_info,
        tail_delta,
        transfer_count_from_server_info,
        transfer_tail_from_server_info,
    )
    from kvpipe.bench.stacks import Endpoint, StackOptions, default_stack_factory
    from kvpipe.bench.sweep import (
        INPROC,
        SliceResult,
        kv_bytes_per_token,
        kv_wire_bytes,
        parse_modes,
        parse_prompt_lens,
        run_sweep,
        run_sweep_interleaved,
        server_page_size,
        state_bytes_per_request,
        sweep_rows,
    )
    from kvpipe.model.presets import resolve_model_path
    from kvpipe.qa.testbed import LinkTestbed, LinkTestbedError, parse_rate

    try:
        lens = parse_prompt_lens(args.prompt_lens if compare else args.sweep_prompt_lens)
        modes = list(COMPARE_MODES) if compare else parse_modes(args.modes)
        rate_bps = parse_rate(args.link_rate)[1] if args.link_rate else None
    except ValueError as e:
        raise SystemExit(f"kvpipe bench serve: {e}") from None
    model_path = resolve_model_path(args.model_path)
    vocab = _vocab_size(args, model_path)
    configs = {n: _workload_config(args, vocab, n) for n in lens}  # same prompts for every mode
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-bench-serve-")  # server logs, always kept
    threads: dict[str, Any] = {}  # mode -> server name -> the cpu_threads its /server_info reported
    load_before = _load_average()
    opts = StackOptions(model_path, tuple(shlex.split(args.server_args)), log_dir, args.startup_timeout)

    def readings(ep: Endpoint) -> tuple[Any, Any]:
        """(transfer tail, transfer count) of the prefill now, from one /server_info fetch."""
        info = ep.call(read_server_info, ep.info_url)
        if info is None:
            return None, None
        return transfer_tail_from_server_info(info), transfer_count_from_server_info(info)

    def measure(ep: Endpoint, mode: str, n: int) -> tuple[dict, int | None, float | None, float | None]:
        pd = ep.info_url is not None and mode != INPROC
        before: list = []
        summary, _ = _measure(
            ep.call, ep.url, configs[n], args, f"{mode} len={n}", lambda: before.append(readings(ep)) if pd else None
        )
        if not pd:
            return summary, None, None, None
        (tail0, count0), (tail1, count1) = before[0], readings(ep)
        count = count_delta(count0, count1)
        return (
            summary,
            ep.call(read_num_groups, ep.info_url),
            tail_delta(tail0, tail1),
            count.per_room if count else None,
        )

    # a round is `concurrency` conversations (single turn: requests), never a split conversation
    slices = {n: split_rounds(build_workload(configs[n]), args.concurrency) for n in lens} if args.interleave else {}
    rounds = len(next(iter(slices.values()))) if slices else 0

    def measure_slice(ep: Endpoint, mode: str, n: int, r: int) -> SliceResult:
        from kvpipe.bench.client import run_workload

        cfg, desc = configs[n], f"{mode} len={n} round {r + 1}/{rounds}"
        pd = ep.info_url is not None and mode != INPROC
        if r == 0 and args.warmup_requests > 0:
            warm = _warmup_config(cfg, args)
            ep.call(run_workload, ep.url, build_workload(warm), args.concurrency, args.timeout, False, desc)
        sub = slices[n][r]
        before = readings(ep) if pd else None
        res = ep.call(run_workload, ep.url, sub, args.concurrency, args.timeout, not args.no_progress, desc)
        if before is None:
            return SliceResult(res.records, res.duration_s)
        after = readings(ep)
        return SliceResult(
            res.records,
            res.duration_s,
            ep.call(read_num_groups, ep.info_url),
            tail_delta(before[0], after[0]),
            count_delta(before[1], after[1]),
        )

    def summarize_records(records: Any, duration_s: float) -> dict:
        from kvpipe.bench.latency import first_errors, summarize

        summary = summarize(records, duration_s)
        if first_errors(records):
            summary["errors"] = first_errors(records)
        return summary

    try:
        with contextlib.ExitStack() as stack:
            tb = stack.enter_context(LinkTestbed(args.link_rate)) if args.link_rate else None
            factory = _reporting_threads(default_stack_factory(opts, tb), threads)
            if args.interleave:
                points = run_sweep_interleaved(lens, modes, factory, measure_slice, rounds, summarize_records)
            else:
                points = run_sweep(lens, modes, factory, measure)
    except (LinkTestbedError, RuntimeError, TimeoutError) as e:  # a stack that did not start
        raise SystemExit(f"kvpipe bench serve: {e} (server logs in {log_dir})") from None
    hf = model_config(model_path) or {}
    rows = sweep_rows(
        points,
        rate_bps,
        kv_bytes_per_token(hf),
        state_bytes_per_request(hf) or 0,
        kv_wire_bytes(hf, server_page_size(opts.server_args)),
    )
    result = {
        "model_path": model_path,
        "log_dir": log_dir,
        "link_rate": args.link_rate or "loopback",
        "link_rate_bps": rate_bps,
        "modes": modes,
        "interleaved": args.interleave,
        "server_args": list(opts.server_args),
        "workload": _config_dict(configs[lens[0]], args) | {"prompt_lens": lens},
        "rows": rows,
        "summaries": [{"prompt_len": p.prompt_len, "mode": p.mode, **p.summary} for p in points],
        "cpu_threads": threads,
        "machine": _machine(load_before),
    }
    if compare:
        result["compare"] = compare_rows(points)
        title = f"kvpipe PD vs colocated, {args.num_requests} req, c={args.concurrency}"
        servers = {**threads.get(COMPARE_MODES[0], {}), **threads.get(COMPARE_MODES[1], {})}
        _emit(result, args, lambda path: plot_modes(rows, path, title), compare_table(result["compare"], servers))
        return 0 if all(p.summary["completed"] for p in points) else 1
    title = f"kvpipe sweep, link {result['link_rate']}, {args.num_requests} req/point, c={args.concurrency}"
    if args.num_prefix_groups or args.num_turns > 1:  # one workload's modes side by side: bars
        if args.num_prefix_groups:
            title += f", {args.num_prefix_groups} prefix groups of {args.prefix_len} tokens"
        if args.num_turns > 1:
            title += f", {args.num_turns} turns (+{args.turn_len} tokens each)"
        _emit(result, args, lambda path: plot_modes(rows, path, title))
    else:
        _emit(result, args, lambda path: plot_sweep(rows, path, title))
    return 0 if all(p.summary["completed"] for p in points) else 1


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit while we run, so every `finally` stops the servers we started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _machine(load_before: float | None) -> dict[str, Any]:
    """The CPU, the cores we may use, and the 1-minute load average before our servers started
    (other work on a shared machine shows there)."""
    from kvpipe.bench.engine import cpu_name
    from kvpipe.engine.cpu_threads import affinity_cores

    return {"cpu": cpu_name(), "cores": len(affinity_cores()), "load_avg_1m_before": load_before}


def _reporting_threads(
    open_stack: Callable[[str], contextlib.AbstractContextManager[Any]], into: dict[str, Any]
) -> Callable[[str], contextlib.AbstractContextManager[Any]]:
    """`open_stack` that also records, per mode, each started server's /server_info cpu_threads."""
    from kvpipe.bench.probe import read_server_info

    @contextlib.contextmanager
    def opened(mode: str) -> Iterator[Any]:
        with open_stack(mode) as ep:
            into[mode] = {name: (ep.call(read_server_info, url) or {}).get("cpu_threads") for name, url in ep.servers}
            yield ep

    return opened


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    if args.compare_colocated:
        if args.url or args.sweep_prompt_lens or args.link_rate:
            raise SystemExit(
                "kvpipe bench serve: --compare-colocated starts its own stacks on this machine "
                "(no --url, --sweep-prompt-lens or --link-rate); the workload's --prompt-lens "
                "are its points"
            )
        if args.interleave and not math.isinf(args.request_rate):
            raise SystemExit("kvpipe bench serve: --interleave applies without --request-rate")
        with _sigterm_as_exit():
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
    if args.link_rate and not args.sweep_prompt_lens:
        raise SystemExit("kvpipe bench serve: --link-rate applies to sweeps (the stacks started here)")
    with _sigterm_as_exit():
        return run_sweep_cmd(args) if args.sweep_prompt_lens else run_single(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe bench serve", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
