"""PNG plots over several recorded `kvpipe bench serve` results (`kvpipe bench plot a.json b.json`):

- sweeps on the emulated link at several rates (layer pipelining): at each run's longest prompt,
  the exposed transfer (TTFT - TTFT(inproc)) of the plain path and of each pipelined mode against
  T/C (the KV at line rate over the colocated TTFT), with the bound max(0, T - C) + 1.5 C/N;
  and at the shortest prompt the pipelined TTFT over the plain path's;
- PD against colocated (--compare-colocated) at several concurrencies: e2e p50 of both, and the
  PD / colocated ratios of e2e and TTFT, per order (interleaved or sequential).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpipe.bench.plotting import machine_line, pyplot, save

Result = Mapping[str, Any]


def _row(run: Result, mode: str, prompt_len: int) -> Mapping[str, Any] | None:
    return next((r for r in run["rows"] if r["mode"] == mode and r["prompt_len"] == prompt_len), None)


def _pipelined_modes(runs: Sequence[Result]) -> list[str]:
    return list(dict.fromkeys(m for run in runs for m in run["modes"] if m.startswith("pipelined")))


def link_points(run: Result, mode: str) -> dict[str, float] | None:
    """At the run's longest prompt: T/C, the plain path's and `mode`'s exposed transfer, and the
    bound (ms); None where the run lacks a part."""
    n = max(r["prompt_len"] for r in run["rows"])
    inproc, base, pipe = _row(run, "inproc", n), _row(run, "baseline", n), _row(run, mode, n)
    if not (inproc and base and pipe and pipe.get("ideal_transfer_ms") and pipe.get("num_groups")):
        return None
    c, t = inproc["ttft_p50_ms"], pipe["ideal_transfer_ms"]
    return {
        "t_over_c": t / c,
        "baseline": base["exposed_transfer_ms"],
        "pipelined": pipe["exposed_transfer_ms"],
        "bound": max(0.0, t - c) + 1.5 * c / pipe["num_groups"],
    }


def plot_link_sweep(runs: Sequence[Result], path: str | Path) -> Path:
    """Exposed transfer against T/C over runs at several link rates (see the module doc)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    for i, mode in enumerate(_pipelined_modes(runs)):
        pts = sorted((p for run in runs if (p := link_points(run, mode))), key=lambda p: p["t_over_c"])
        xs = [p["t_over_c"] for p in pts]
        if i == 0:
            ax1.plot(xs, [p["baseline"] for p in pts], "s", color="gray", label="plain path (1 group)")
        ax1.plot(xs, [p["pipelined"] for p in pts], "o", color=f"C{i}", label=mode)
        ax1.plot(xs, [p["bound"] for p in pts], "x--", color=f"C{i}", alpha=0.6, lw=0.8, label=f"bound ({mode})")
        short = []
        for run in runs:
            n = min(r["prompt_len"] for r in run["rows"])
            base, pipe = _row(run, "baseline", n), _row(run, mode, n)
            if base and pipe and pipe.get("t_over_c") and base["ttft_p50_ms"]:
                short.append((pipe["t_over_c"], pipe["ttft_p50_ms"] / base["ttft_p50_ms"], n))
        short.sort()
        if short:
            ax2.plot(
                [s[0] for s in short], [s[1] for s in short], "o", color=f"C{i}", label=f"{mode}, {short[0][2]} tok"
            )
    ax1.set(xlabel="T / C at the longest prompt", ylabel="exposed transfer (ms)", title="KV transfer left on TTFT")
    ax2.set(xlabel="T / C", ylabel="TTFT / plain path's TTFT", title="short prompts")
    ax2.axhline(1.0, color="gray", lw=0.8, ls=":")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    n = max(r["prompt_len"] for r in runs[0]["rows"])
    machine = machine_line(runs[0].get("machine"))
    fig.suptitle(
        f"layer-pipelined KV transfer, {len(runs)} runs on the emulated link, {n}-token prompts"
        + (f" — {machine}" if machine else ""),
        fontsize=10,
    )
    return save(plt, fig, path)


def plot_compare_runs(results: Sequence[Result], path: str | Path) -> Path:
    """PD against colocated over several --compare-colocated results (see the module doc)."""
    plt = pyplot()
    series: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for res in results:
        order = "interleaved" if res.get("interleaved") else "sequential"
        for cmp in res["compare"]:
            series.setdefault(f"{order}, {cmp['prompt_len']} tok", []).append((res["workload"]["concurrency"], cmp))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, (name, pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda p: p[0])
        xs = [c for c, _ in pts]
        style = "-" if name.startswith("interleaved") else "--"
        ax1.plot(xs, [p["pd"]["e2e_p50_ms"] for _, p in pts], "o" + style, color=f"C{i}", label=f"PD, {name}")
        ax1.plot(
            xs,
            [p["colocated"]["e2e_p50_ms"] for _, p in pts],
            "s" + style,
            color=f"C{i}",
            alpha=0.5,
            label=f"colocated, {name}",
        )
        ax2.plot(xs, [p["ratio"]["e2e_p50_ms"] for _, p in pts], "o" + style, color=f"C{i}", label=f"e2e, {name}")
        ax2.plot(
            xs,
            [p["ratio"]["ttft_p50_ms"] for _, p in pts],
            "^" + style,
            color=f"C{i}",
            alpha=0.5,
            label=f"TTFT, {name}",
        )
    ax1.set(xlabel="concurrency", ylabel="e2e p50 (ms)", title="end-to-end latency", xscale="log")
    ax2.set(xlabel="concurrency", ylabel="PD / colocated (p50)", title="PD / colocated", xscale="log")
    ax2.axhline(1.0, color="gray", lw=0.8, ls=":")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({c for pts in series.values() for c, _ in pts}))
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    model = Path(str(results[0].get("model_path") or "tiny preset")).name
    machine = machine_line(results[0].get("machine"))
    fig.suptitle(f"PD stack vs colocated server: {model}" + (f" — {machine}" if machine else ""), fontsize=10)
    return save(plt, fig, path)
