"""What every benchmark's PNG plot shares (matplotlib, Agg backend: no display needed): the pyplot
module, grouped bars with their values written on them, and saving a figure.

Each benchmark draws its own figure (bench/<name>/plot.py); `kvpipe bench plot` draws any recorded
result again (bench/plot_command.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported here, on first use: a benchmark that writes
    no plot never loads matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write the figure as PNG (parent folders made) and free it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def grouped_bars(
    ax: Any,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    ylabel: str,
    title: str,
    fmt: str = "{:.3g}",
    log: bool = False,
) -> None:
    """One group of bars per label, one bar per series (a missing value: no bar), each bar's value
    written above it; `series` maps a legend name to one value per label."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not pts:
            continue
        bars = ax.bar([x for x, _ in pts], [v for _, v in pts], width, label=name, color=f"C{i}")
        ax.bar_label(bars, [fmt.format(v) for _, v in pts], fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    if len(series) > 1:
        ax.legend(fontsize=8)


def machine_line(machine: Mapping[str, Any] | None) -> str:
    """'AMD EPYC, 2 cores, 1 thread' from a result's `machine` record (the keys engine, transfer and
    serve results use); '' when there is none."""
    if not machine:
        return ""
    parts = [str(machine["cpu"])] if machine.get("cpu") else []
    cores = machine.get("cpu_count") or machine.get("cores")
    if cores:
        parts.append(f"{cores} cores")
    if machine.get("threads"):
        parts.append(f"{machine['threads']} thread" + ("s" if machine["threads"] != 1 else ""))
    return ", ".join(parts)
