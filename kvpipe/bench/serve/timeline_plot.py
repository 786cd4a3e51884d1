"""`kvpipe bench serve --timeline out.png`: each request's phases as horizontal bars.

The servers' timelines (kvpipe/engine/timeline.py, as `/debug/requests` keeps them: sglang-router
drops `return_timeline`) become bars on one row per request, in CLOCK_MONOTONIC seconds since the
first request arrived (one host: the servers share that clock):

  prefill compute  each chunk's forward (forward_start -> forward_end), prefill or colocated
  KV transfer      each stretch of the room's writes in flight (transfer_start -> transfer_done): one
                   per layer group where the link keeps up, drawn under the compute so the overlap
                   layer pipelining buys shows
  decode           first token -> finished (a PD decode: from the KV's arrival)

A PD request's two halves are one row: the decode's entry and the prefill's of the same
bootstrap room.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpipe.bench.serve.plot import _pyplot, _save

PREFILL_COMPUTE, KV_TRANSFER, DECODE = "prefill compute", "KV transfer", "decode"
PHASES = (PREFILL_COMPUTE, KV_TRANSFER, DECODE)
_COLORS = {PREFILL_COMPUTE: "tab:blue", KV_TRANSFER: "tab:orange", DECODE: "tab:green"}
_OFFSET = {PREFILL_COMPUTE: 0.22, KV_TRANSFER: -0.22, DECODE: 0.0}  # rows: compute above the wire


@dataclass(frozen=True)
class Bar:
    phase: str
    start: float  # CLOCK_MONOTONIC seconds
    end: float


@dataclass(frozen=True)
class RequestBars:
    label: str  # the row's name (rid, or room)
    bars: tuple[Bar, ...]


def _times(timeline: Mapping[str, Any], phase: str) -> list[float]:
    base = float(timeline["arrived_monotonic"])
    return [base + float(e["t"]) for e in timeline["events"] if e["phase"] == phase]


def _pairs(timeline: Mapping[str, Any], start: str, end: str, phase: str) -> list[Bar]:
    return [Bar(phase, a, b) for a, b in zip(_times(timeline, start), _times(timeline, end))]


def bars_of(timeline: Mapping[str, Any], role: str) -> list[Bar]:
    """One server's bars of a request (`timeline`: meta_info.timeline / /debug/requests form)."""
    bars = _pairs(timeline, "forward_start", "forward_end", PREFILL_COMPUTE)
    bars += _pairs(timeline, "transfer_start", "transfer_done", KV_TRANSFER)
    if role != "prefill":  # a prefill emits only the first token
        began = _times(timeline, "kv_arrived" if role == "decode" else "first_token")
        done = _times(timeline, "finished")
        if began and done and done[0] > began[0]:
            bars.append(Bar(DECODE, began[0], done[0]))
    return bars


def request_bars(entries: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[RequestBars]:
    """Rows from /debug/requests entries by server role: a decode's (or colocated server's)
    entry with the prefill entry of its bootstrap room, in arrival order."""
    by_room = {e.get("bootstrap_room"): e for e in entries.get("prefill", ())}
    rows: list[tuple[float, RequestBars]] = []
    for role in ("decode", "colocated"):
        for e in entries.get(role, ()):
            tl = e["timeline"]
            bars = bars_of(tl, role)
            arrived = float(tl["arrived_monotonic"])
            p = by_room.get(e.get("bootstrap_room")) if role == "decode" else None
            if p is not None:
                bars = bars_of(p["timeline"], "prefill") + bars
                arrived = min(arrived, float(p["timeline"]["arrived_monotonic"]))
            rows.append((arrived, RequestBars(str(e.get("rid")), tuple(bars))))
    return [r for _, r in sorted(rows, key=lambda x: x[0])]


def timeline_figure(rows: Sequence[RequestBars], title: str = "kvpipe request timelines") -> Any:
    """The figure: one `barh` container per phase (its label: the phase), one bar per Bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, max(2.5, 0.32 * len(rows) + 1.5)))
    t0 = min((b.start for r in rows for b in r.bars), default=0.0)
    for phase in PHASES:
        ys, lefts, widths = [], [], []
        for i, r in enumerate(rows):
            for b in r.bars:
                if b.phase == phase:
                    ys.append(i + _OFFSET[phase])
                    lefts.append((b.start - t0) * 1e3)
                    widths.append(max((b.end - b.start) * 1e3, 0.0))
        if ys:
            ax.barh(ys, widths, left=lefts, height=0.4, color=_COLORS[phase], label=phase)
    ax.set_yticks(range(len(rows)), [r.label[:24] for r in rows], fontsize=7)
    ax.invert_yaxis()  # the first request on top
    ax.set(xlabel="ms since the first request arrived", title=title)
    ax.grid(axis="x", alpha=0.3)
    if rows:
        ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_timelines(rows: Sequence[RequestBars], path: str | Path, title: str = "kvpipe request timelines") -> Path:
    plt = _pyplot()
    return _save(plt, timeline_figure(rows, title), path)
