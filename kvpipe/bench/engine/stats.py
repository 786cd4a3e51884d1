"""Bookkeeping of `kvpipe bench engine`: plans, medians, throughputs and the table (no torch).

Timings come in as plain seconds; everything here is a pure function so it is unit-tested
without running a model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrefillPoint:
    prompt_len: int
    batch: int  # requests prefilled together (added before the first step)


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # requests decoding together in every timed step
    context: int  # prompt tokens of each request (KV already cached when decode timing starts)
    steps: int  # timed decode steps per repeat
    warmup_steps: int = 0  # untimed full-batch decode steps before the timed ones


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'256,1024' -> (256, 1024); every value a positive integer, order kept, duplicates dropped."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"kvpipe bench engine: {flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"kvpipe bench engine: {flag} needs positive integers, got {text!r}")
    return tuple(dict.fromkeys(vals))


def prefill_points(prompt_lens: Sequence[int], batch_sizes: Sequence[int]) -> list[PrefillPoint]:
    """Each prompt length at batch 1 and at every other prefill batch size given."""
    sizes = sorted(set(batch_sizes) | {1})
    return [PrefillPoint(n, b) for n in prompt_lens for b in sizes]


def decode_points(batch_sizes: Sequence[int], context: int, steps: int, warmup_steps: int = 0) -> list[DecodePoint]:
    return [DecodePoint(b, context, steps, warmup_steps) for b in batch_sizes]


def decode_max_new_tokens(point: DecodePoint, prefill_budget: int) -> int:
    """max_new_tokens for a decode request: the warm-up and timed steps, plus the decode steps that may run
    while the batch is still being prefilled (at most one per prefill step, and there are at
    most ceil(context / budget) + 1 of those per request), plus the token each prefill yields."""
    prefill_steps = point.batch * (math.ceil(point.context / max(prefill_budget, 1)) + 1)
    return point.warmup_steps + point.steps + prefill_steps + 1


def kv_tokens_needed(prefill: Sequence[PrefillPoint], decode: Sequence[DecodePoint], prefill_budget: int) -> int:
    """KV slots the largest point can ever hold at once (the scheduler admits by this bound)."""
    need = [p.batch * p.prompt_len for p in prefill]
    need += [d.batch * (d.context + decode_max_new_tokens(d, prefill_budget)) for d in decode]
    return max(need, default=1)


def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("median of no samples")
    return float(statistics.median(xs))


def cpu_per_wall(cpu_s: float, wall_s: float) -> float:
    """Process CPU seconds per wall second: about the torch thread count when the process had
    its cores to itself, less when other processes took them (a loaded, shared machine)."""
    return cpu_s / wall_s if wall_s > 0 else 0.0


def _median_or_none(xs: Sequence[float]) -> float | None:
    return median(xs) if xs else None


def summarize_prefill(
    point: PrefillPoint, times_s: Sequence[float], steps: Sequence[int], cpu_ratios: Sequence[float] = ()
) -> dict[str, Any]:
    """One prefill point from per-repeat wall times (seconds to prefill the whole batch) and,
    optionally, each repeat's cpu_per_wall."""
    t = median(times_s)
    tokens = point.prompt_len * point.batch
    return {
        "prompt_len": point.prompt_len,
        "batch": point.batch,
        "repeats": len(times_s),
        "ms_per_prefill": 1000.0 * t,
        "ms_min": 1000.0 * min(times_s),
        "ms_max": 1000.0 * max(times_s),
        "tokens_per_s": tokens / t if t > 0 else math.inf,
        "steps": int(median(steps)),
        "cpu_per_wall": _median_or_none(cpu_ratios),
        "times_s": [float(x) for x in times_s],
    }


def summarize_decode(
    point: DecodePoint, step_times_s: Sequence[Sequence[float]], cpu_ratios: Sequence[float] = ()
) -> dict[str, Any]:
    """One decode point from each repeat's list of step times (seconds, all at full batch).

    Per repeat the mean step time; the median of those over repeats is the headline figure.
    """
    if not step_times_s or any(len(r) == 0 for r in step_times_s):
        raise ValueError("every repeat needs at least one timed decode step")
    per_repeat = [sum(r) / len(r) for r in step_times_s]
    t = median(per_repeat)
    flat = [x for r in step_times_s for x in r]
    return {
        "batch": point.batch,
        "context": point.context,
        "steps": point.steps,
        "warmup_steps": point.warmup_steps,
        "repeats": len(step_times_s),
        "ms_per_step": 1000.0 * t,
        "ms_per_step_p50": 1000.0 * median(flat),
        "ms_per_step_max": 1000.0 * max(flat),
        "tokens_per_s": point.batch / t if t > 0 else math.inf,
        "cpu_per_wall": _median_or_none(cpu_ratios),
        "ms_per_step_by_repeat": [1000.0 * x for x in per_repeat],
    }


def compare_prefill(row: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """A prefill row with the HF row of the same point and kvpipe/HF time (< 1: kvpipe faster)."""
    return {**row, "hf": hf, "time_ratio_vs_hf": row["ms_per_prefill"] / hf["ms_per_prefill"]}


def compare_decode(row: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """A decode row with the HF row of the same point and kvpipe/HF throughput (> 1: kvpipe faster)."""
    return {**row, "hf": hf, "throughput_ratio_vs_hf": row["tokens_per_s"] / hf["tokens_per_s"]}


def compare_dtype_prefill(row: dict[str, Any], other: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A prefill row with the --compare-dtype engine's row and this/that time (< 1: this faster)."""
    ratio = row["ms_per_prefill"] / other["ms_per_prefill"]
    return {**row, "other_dtype": {**other, "dtype": dtype}, "time_ratio_vs_dtype": ratio}


def compare_dtype_decode(row: dict[str, Any], other: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A decode row with the --compare-dtype engine's row and this/that step time (< 1: this faster)."""
    ratio = row["ms_per_step"] / other["ms_per_step"]
    return {**row, "other_dtype": {**other, "dtype": dtype}, "step_ratio_vs_dtype": ratio}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(report: dict[str, Any]) -> str:
    m, c = report["machine"], report["config"]
    hf = c.get("compare_hf")
    other = c.get("compare_dtype")  # --compare-dtype: the second engine's dtype
    rows = [
        f"{c['model']} | dtype {c.get('run_dtype', 'auto')} | tp {c['tp_size']} | "
        f"KV {c.get('kv_cache_dtype', 'auto')} | page {c['page_size']} | "
        f"chunk {c['chunked_prefill_size']} | "
        f"median of {c['repeat']} | torch {m['torch']} | {m['threads']} threads | "
        f"{m['cpu']}" + (f" | HF transformers {hf['attn_implementation']}, {hf['threads']} threads" if hf else ""),
        "",
        f"prefill ({c['warmup']} warm-up run per point)",
        f"{'tokens':>7} {'batch':>5} {'ms':>10} {'tok/s':>10} {'steps':>5} {'cpu/wall':>8}"
        + f" {'floor ms':>9} {'x floor':>7}"
        + (f" {other + ' ms':>15} {'time ratio':>10}" if other else "")
        + (f" {'HF ms':>10} {'kvpipe/HF time':>15}" if hf else ""),
    ]
    for x in report["prefill"]:
        rows.append(
            f"{x['prompt_len']:>7} {x['batch']:>5} {x['ms_per_prefill']:>10.1f} "
            f"{x['tokens_per_s']:>10.0f} {x['steps']:>5} {_fmt(x['cpu_per_wall']):>8}"
            + f" {_fmt(x.get('floor_ms')):>9} {_fmt(x.get('x_floor')):>7}"
            + (f" {x['other_dtype']['ms_per_prefill']:>15.1f} {x['time_ratio_vs_dtype']:>10.2f}" if other else "")
            + (f" {x['hf']['ms_per_prefill']:>10.1f} {x['time_ratio_vs_hf']:>15.2f}" if "hf" in x else "")
        )
    rows += [
        "",
        f"decode (context {c['decode_context']}, {c['output_len']} timed steps after "
        f"{c['decode_warmup_steps']} warm-up steps, fresh prefill per repeat)",
        f"{'batch':>5} {'ms/step':>9} {'tok/s':>9} {'p50 ms':>8} {'max ms':>8} {'cpu/wall':>8}"
        + f" {'MB read':>8} {'floor ms':>9} {'x floor':>7}"
        + (f" {other + ' ms':>15} {'step ratio':>10}" if other else "")
        + (f" {'HF ms':>9} {'kvpipe/HF tok/s':>16}" if hf else ""),
    ]
    for x in report["decode"]:
        read = None if x.get("weight_bytes") is None else (x["weight_bytes"] + x["kv_bytes"]) / 1e6
        rows.append(
            f"{x['batch']:>5} {x['ms_per_step']:>9.2f} {x['tokens_per_s']:>9.1f} "
            f"{x['ms_per_step_p50']:>8.2f} {x['ms_per_step_max']:>8.2f} {_fmt(x['cpu_per_wall']):>8}"
            + f" {_fmt(read):>8} {_fmt(x.get('floor_ms')):>9} {_fmt(x.get('x_floor')):>7}"
            + (f" {x['other_dtype']['ms_per_step']:>15.2f} {x['step_ratio_vs_dtype']:>10.2f}" if other else "")
            + (f" {x['hf']['ms_per_step']:>9.2f} {x['throughput_ratio_vs_hf']:>16.2f}" if "hf" in x else "")
        )
    peaks = report.get("peaks")
    if peaks:
        rows += [
            "",
            f"floors: decode = (weight + KV bytes) / {peaks['bandwidth_gb_s']:.1f} GB/s read bandwidth; prefill = "
            f"FLOPs / {peaks['matmul_tflop_s']:.3f} TFLOP/s {peaks['dtype']} matmul peak (both measured in this run)",
        ]
    return "\n".join(rows)


def compare_llamacpp_prefill(row: dict[str, Any], lc: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A prefill row with llama.cpp's rows of the same point, per GGUF type, and kvpipe/llama.cpp
    time per type (< 1: kvpipe faster)."""
    ratios = {k: row["ms_per_prefill"] / r["ms_per_prefill"] for k, r in lc.items()}
    return {**row, "llamacpp": lc, "time_ratio_vs_llamacpp": ratios}


def compare_llamacpp_decode(row: dict[str, Any], lc: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A decode row with llama.cpp's rows, per GGUF type, and kvpipe/llama.cpp time per step
    (< 1: kvpipe faster)."""
    ratios = {k: row["ms_per_step"] / r["ms_per_step"] for k, r in lc.items()}
    return {**row, "llamacpp": lc, "step_ratio_vs_llamacpp": ratios}
