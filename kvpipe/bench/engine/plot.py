"""PNG plots of `kvpipe bench engine` results (one report, or the `runs` of one invocation):

- against a reference engine (--compare-llamacpp, --compare-hf): prefill time and decode time per
  step, kvpipe's bar beside the reference's for every point, the ratio in the point's label;
- speculative decoding (--speculative-algorithm): decode tokens/s without and with it per run,
  with the accepted tokens per verify step;
- otherwise kvpipe's own prefill time and decode step time per point, one bar per engine mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpipe.bench.plotting import grouped_bars, machine_line, pyplot, save

Report = Mapping[str, Any]


def mode_label(report: Report, reports: Sequence[Report]) -> str:
    """The engine's mode as the runs of one plot tell them apart: quantization (fp32 for none), and
    the fused-layer mode and KV dtype where they vary among `reports`."""
    cfg = report["config"]
    label = cfg.get("quantization") or "none"
    label = "fp32" if label == "none" else str(label)
    for key in ("decode_fused_layer", "kv_cache_dtype"):
        if len({r["config"].get(key) for r in reports}) > 1:
            label += f" {cfg.get(key)}"
    return label


def _reference(point: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """(reference name, its figures) of a prefill or decode point: llama.cpp's first type, or HF."""
    if point.get("llamacpp"):
        kind, figures = next(iter(point["llamacpp"].items()))
        return f"llama.cpp {kind}", figures
    if point.get("hf"):
        return "HF transformers", point["hf"]
    return None


def _title(reports: Sequence[Report], what: str) -> str:
    """The command and the machine, and the model where the points' labels do not name it."""
    cfg = reports[0]["config"]
    model = "" if what else ": " + Path(str(cfg.get("model") or cfg.get("model_path") or "?")).name
    machine = dict(reports[0].get("machine") or {})
    if len({(r.get("machine") or {}).get("threads") for r in reports}) > 1:
        machine.pop("threads", None)  # runs with other thread counts: the labels' runs differ
    line = machine_line(machine)
    return f"kvpipe bench engine{what}{model}" + (f" — {line}" if line else "")


def _points(
    reports: Sequence[Report], key: str, name: str, value: str
) -> tuple[list[str], dict[str, list[float | None]]]:
    """Labels and {kvpipe, reference...} values of every prefill (`key` "prefill") or decode point;
    a reference's series has a value only at the points it ran."""
    rows: list[tuple[str, float, str | None, float | None]] = []
    for r in reports:
        for pt in r.get(key, ()):
            ref = _reference(pt)
            where = f"{pt['prompt_len']} tok b{pt['batch']}" if key == "prefill" else f"b{pt['batch']}"
            label = f"{mode_label(r, reports)}\n{where}"
            if ref is not None:
                label += f"\n{pt[value] / ref[1][value]:.2f}x the time"
            rows.append((label, pt[value], ref and ref[0], ref and ref[1][value]))
    series: dict[str, list[float | None]] = {name: [ours for _, ours, _, _ in rows]}
    for ref_name in dict.fromkeys(n for _, _, n, _ in rows if n):
        series[ref_name] = [v if n == ref_name else None for _, _, n, v in rows]
    return [label for label, _, _, _ in rows], series


def plot_engine(reports: Sequence[Report], path: str | Path) -> Path:
    """Prefill and decode panels of one invocation's reports (see the module doc); speculative
    reports go to plot_speculative."""
    if any("speculative" in r for r in reports):
        return plot_speculative(reports, path)
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels, series = _points(reports, "prefill", "kvpipe", "ms_per_prefill")
    grouped_bars(ax1, labels, series, "ms per prefill (lower is better)", "prefill", fmt="{:,.0f}")
    labels, series = _points(reports, "decode", "kvpipe", "ms_per_step")
    grouped_bars(ax2, labels, series, "ms per decode step (lower is better)", "decode", fmt="{:.1f}")
    fig.suptitle(_title(reports, ""), fontsize=10)
    return save(plt, fig, path)


def plot_speculative(reports: Sequence[Report], path: str | Path) -> Path:
    """Decode tokens/s without and with speculation per run (model, workload, batch), the speedup
    and accept length in each run's label."""
    plt = pyplot()
    runs = [r for r in reports if "speculative" in r]
    labels, off, on = [], [], []
    for r in runs:
        s = r["speculative"]
        model = Path(str(r["config"].get("model") or "?")).name
        labels.append(
            f"{model}\n{s['algorithm']} {s['workload']} b{s['batch']}\n"
            f"{s['speedup']:.2f}x, accept {s['accept_length']:.2f}"
        )
        off.append(s["decode_tokens_per_s_off"])
        on.append(s["decode_tokens_per_s_on"])
    fig, ax = plt.subplots(figsize=(max(6.0, 2.6 * len(runs)), 4.8))
    grouped_bars(ax, labels, {"without": off, "with speculation": on}, "decode tokens/s (higher is better)", "")
    fig.suptitle(_title(runs, " --speculative-algorithm"), fontsize=10)
    return save(plt, fig, path)
