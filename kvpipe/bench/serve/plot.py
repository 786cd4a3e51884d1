"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpipe.harness.latency import completed_metrics
from kvpipe.harness.outcome import Outcome


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_run(
    records: Sequence[Outcome], summary: Mapping[str, Any], path: str | Path, title: str = "kvpipe bench serve"
) -> Path:
    """Two panels: CDFs of TTFT and e2e latency, and the ITL histogram (all in ms)."""
    plt = _pyplot()
    done = completed_metrics(records)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _cdf(ax1, [m.ttft_s * 1e3 for m in done], "TTFT")
    _cdf(ax1, [m.e2e_s * 1e3 for m in done], "end to end")
    ax1.set(xlabel="latency (ms)", ylabel="fraction of requests", title="latency CDF", ylim=(0, 1.02))
    ax1.grid(alpha=0.3)
    ax1.legend()
    itl = [x * 1e3 for m in done for x in m.itl_s]
    if itl:
        lo, hi = min(itl), max(itl)
        if hi - lo < 1e-3:  # (nearly) equal values: numpy cannot split a float-noise range into bins
            lo, hi = lo - 0.5, hi + 0.5
        ax2.hist(itl, bins=min(50, max(5, len(itl) // 4)), range=(lo, hi))
    ax2.set(xlabel="inter-token latency (ms)", ylabel="tokens", title="ITL")
    ax2.grid(alpha=0.3)

    def fmt(key: str) -> str:
        v = summary.get(key)
        return "n/a" if v is None else f"{v:.1f}"

    fig.suptitle(
        f"{title} — {summary.get('completed')}/{summary.get('num_requests')} ok, "
        f"TTFT p50 {fmt('ttft_p50_ms')} ms, TPOT p50 {fmt('tpot_p50_ms')} ms, "
        f"{fmt('output_throughput')} tok/s"
    )
    return _save(plt, fig, path)


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "kvpipe serving sweep") -> Path:
    """TTFT (p50 solid, p99 dashed) vs prompt length per mode; exposed transfer time per PD mode
    (and the KV tail after the forward with the 1.5/N target when the rows carry them), with the
    ideal line-rate transfer time when the rows carry it."""
    plt = _pyplot()
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, mode in enumerate(modes):
        pts = sorted(
            (r for r in rows if r["mode"] == mode and r["ttft_p50_ms"] is not None), key=lambda r: r["prompt_len"]
        )
        color = f"C{i}"
        xs = [r["prompt_len"] for r in pts]
        ax1.plot(xs, [r["ttft_p50_ms"] for r in pts], "o-", color=color, label=f"{mode} p50")
        p99 = [(r["prompt_len"], r["ttft_p99_ms"]) for r in pts if r["ttft_p99_ms"] is not None]
        if p99:
            ax1.plot(*zip(*p99), "--", color=color, alpha=0.5, label=f"{mode} p99")
        exp = [(r["prompt_len"], r["exposed_transfer_ms"]) for r in pts if r.get("exposed_transfer_ms") is not None]
        if exp:
            ax2.plot(*zip(*exp), "o-", color=color, label=mode)
            for r in pts:  # the group count each PD point used, when the prefill reported it
                if r.get("num_groups") and r.get("exposed_transfer_ms") is not None:
                    ax2.annotate(
                        f"N={r['num_groups']}",
                        (r["prompt_len"], r["exposed_transfer_ms"]),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                        color=color,
                    )
        tail = [(r["prompt_len"], r["transfer_tail_ms"]) for r in pts if r.get("transfer_tail_ms") is not None]
        if tail:  # the prefill's own measure: KV still landing after the forward
            ax2.plot(*zip(*tail), "s--", color=color, alpha=0.6, label=f"{mode}: KV tail after forward")
    base_tail = {
        r["prompt_len"]: r["transfer_tail_ms"] for r in rows if r["mode"] == "baseline" and r.get("transfer_tail_ms")
    }
    target = sorted(
        (r["prompt_len"], 1.5 / r["num_groups"] * base_tail[r["prompt_len"]])
        for r in rows
        if r.get("transfer_tail_ratio") is not None and r.get("num_groups") and r["prompt_len"] in base_tail
    )
    if target:
        ax2.plot(*zip(*target), "x", color="black", label="1.5/N × baseline tail")
    ideal = sorted({(r["prompt_len"], r["ideal_transfer_ms"]) for r in rows if r.get("ideal_transfer_ms")})
    if ideal:
        ax2.plot(*zip(*ideal), ":", color="gray", label="KV at line rate (T)")
    ax1.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", title="time to first token")
    ax2.set(xlabel="prompt length (tokens)", ylabel="TTFT − TTFT(inproc) (ms)", title="exposed transfer time")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)


def plot_modes(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "kvpipe modes") -> Path:
    """Side by side per mode (one workload, e.g. shared prefixes or multi-turn): TTFT p50 and p99
    bars, and the KV bytes the prefill sent per request."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [
        f"{r['mode']}\n{r['prompt_len']} tok" if len({x["prompt_len"] for x in rows}) > 1 else r["mode"] for r in rows
    ]
    xs = range(len(rows))
    w = 0.4
    ax1.bar([x - w / 2 for x in xs], [r.get("ttft_p50_ms") or 0 for r in rows], w, label="p50")
    ax1.bar([x + w / 2 for x in xs], [r.get("ttft_p99_ms") or 0 for r in rows], w, label="p99", alpha=0.6)
    for x, r in zip(xs, rows):
        if r.get("ttft_speedup_vs_baseline"):
            ax1.annotate(
                f"{r['ttft_speedup_vs_baseline']:.1f}x",
                (x - w / 2, r.get("ttft_p50_ms") or 0),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
            )
    ax1.set(ylabel="TTFT (ms)", title="time to first token")
    kv = [(x, r["kv_bytes_per_request"] / 2**20) for x, r in zip(xs, rows) if r.get("kv_bytes_per_request")]
    if kv:
        ax2.bar([x for x, _ in kv], [v for _, v in kv], 0.6)
    ax2.set(ylabel="MiB per request", title="KV bytes the prefill sent")
    for ax in (ax1, ax2):
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Write the figure as PNG (parent folders made) and free it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
