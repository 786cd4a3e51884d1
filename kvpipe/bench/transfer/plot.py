"""PNG plots of `kvpipe bench transfer` reports.

Same-TP runs: goodput per prompt length of kvpipe, one raw Mooncake op and the best raw pattern
of the same run, and kvpipe / best raw (median of the per-round ratios). Heterogeneous-TP runs
(`mode` "tp"): time per request of same-TP (equal bytes), plain head-slice ops and staged chunks,
and the Mooncake ops each submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpipe.bench.plotting import grouped_bars, pyplot, save

Report = Mapping[str, Any]


def _title(report: Report) -> str:
    c = report["config"]
    shape = f"{c['layers']} layers x {c['kv_heads']} KV heads x {c['head_dim']} {c['dtype']}, page {c['page_size']}"
    tp = f", TP {c['prefill_tp']} -> {c['decode_tp']}" if report.get("mode") == "tp" else ""
    return f"kvpipe bench transfer{tp}: {shape}, link {c.get('link_rate') or 'loopback'}, {c['repeat']} repeats"


def plot_transfer(report: Report, path: str | Path) -> Path:
    """Two panels of one report (see the module doc)."""
    if report.get("mode") == "tp":
        return plot_tp(report, path)
    plt = pyplot()
    rows = report["lengths"]
    labels = [f"{r['prompt_len']:,} tok" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    grouped_bars(
        ax1,
        labels,
        {
            "kvpipe": [r["goodput_gbps"] for r in rows],
            "raw Mooncake, one op": [r.get("raw_goodput_gbps") for r in rows],
            "raw Mooncake, best pattern": [r.get("best_raw_goodput_gbps") for r in rows],
        },
        "GB/s (higher is better)",
        "goodput",
        fmt="{:.2f}",
    )
    ratio = [r.get("best_raw_ratio_paired") or r.get("best_raw_ratio") for r in rows]
    grouped_bars(ax2, labels, {"kvpipe / best raw": ratio}, "ratio (1.0 = the transport's best)", "kvpipe / best raw")
    ax2.axhline(1.0, color="gray", lw=0.8, ls=":")
    fig.suptitle(_title(report), fontsize=10)
    return save(plt, fig, path)


def plot_tp(report: Report, path: str | Path) -> Path:
    """Time per request and ops per request of same-TP, plain and staged transfers."""
    plt = pyplot()
    rows = report["lengths"]
    labels = [f"{r['prompt_len']:,} tok\nstaged/same {r['staged_vs_same']:.2f}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    grouped_bars(
        ax1,
        labels,
        {
            "same TP (equal bytes)": [r["same_ms"] for r in rows],
            "plain head slices": [r["plain_ms"] for r in rows],
            "staged": [r["staged_ms"] for r in rows],
        },
        "ms per request (lower is better)",
        "transfer time",
        fmt="{:.0f}",
    )
    grouped_bars(
        ax2,
        labels,
        {"plain head slices": [r["plain_ops"] for r in rows], "staged": [r["staged_ops"] for r in rows]},
        "Mooncake ops per request",
        "ops submitted",
        fmt="{:,.0f}",
        log=True,
    )
    fig.suptitle(_title(report), fontsize=10)
    return save(plt, fig, path)
