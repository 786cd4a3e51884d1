"""`bench serve --timeline` (kvpipe/bench/serve/timeline_plot.py) from recorded timelines in the form
/debug/requests keeps them: a PD request's prefill and decode halves on one row, a colocated
request alone; the figure has one bar per chunk's forward, per stretch of KV writes and per
decode (read back from its artists), and the file written is a PNG."""

from __future__ import annotations

from kvpipe.bench.serve.timeline_plot import (
    DECODE,
    KV_TRANSFER,
    PREFILL_COMPUTE,
    plot_timelines,
    request_bars,
    timeline_figure,
)
from kvpipe.disagg.timeline_events import record_transfer
from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.transfer.sender.stats import TransferTiming

T0 = 500.0


def recorded(tl: Timeline) -> dict:
    rec = tl.record()
    assert rec is not None
    return rec.to_json()


def prefill(t0: float, chunks: int) -> dict:
    """A layer-pipelined prefill: `chunks` forwards, two stretches of writes per chunk."""
    tl = Timeline()
    tl.mark(Phase.ARRIVED, t0)
    tl.mark(Phase.SCHEDULED, t0 + 0.01)
    spans = []
    for c in range(chunks):
        a = t0 + 0.01 + 0.1 * c
        tl.mark(Phase.FORWARD_START, a, 64)
        tl.mark(Phase.FORWARD_END, a + 0.08, 64)
        spans += [(a + 0.04, a + 0.05), (a + 0.08, a + 0.09)]
    tl.mark(Phase.FIRST_TOKEN, spans[-1][0])
    tl.mark(Phase.FINISHED, spans[-1][0])
    record_transfer(tl, TransferTiming(1, 4096, 0.1, spans[0][0], spans[-1][1], t0 + 0.005, tuple(spans)))
    tl.mark(Phase.RELEASED, spans[-1][1] + 0.001)
    return recorded(tl)


def decode(t0: float) -> dict:
    tl = Timeline()
    for phase, t in [(Phase.ARRIVED, t0), (Phase.PAGES_RESERVED, t0 + 0.002), (Phase.KV_ARRIVED, t0 + 0.4)]:
        tl.mark(phase, t)
    tl.mark(Phase.FIRST_TOKEN, t0 + 0.4)
    tl.mark(Phase.FINISHED, t0 + 0.9)
    return recorded(tl)


def colocated(t0: float) -> dict:
    tl = Timeline()
    tl.mark(Phase.ARRIVED, t0)
    tl.mark(Phase.FORWARD_START, t0 + 0.01, 10)
    tl.mark(Phase.FORWARD_END, t0 + 0.05, 10)
    tl.mark(Phase.FIRST_TOKEN, t0 + 0.05)
    tl.mark(Phase.FINISHED, t0 + 0.3)
    return recorded(tl)


def entries() -> dict[str, list[dict]]:
    return {
        "prefill": [
            {"rid": "p-a", "bootstrap_room": 11, "timeline": prefill(T0, 2)},
            {"rid": "p-b", "bootstrap_room": 12, "timeline": prefill(T0 + 0.05, 3)},
            {"rid": "p-gone", "bootstrap_room": 13, "timeline": prefill(T0, 1)},  # its decode half left the history
        ],
        "decode": [
            {"rid": "b", "bootstrap_room": 12, "timeline": decode(T0 + 0.05)},
            {"rid": "a", "bootstrap_room": 11, "timeline": decode(T0)},
        ],
        "colocated": [{"rid": "c", "bootstrap_room": None, "timeline": colocated(T0 + 1.0)}],
    }


def test_rows_pair_the_halves_of_a_pd_request_in_arrival_order() -> None:
    rows = request_bars(entries())
    assert [r.label for r in rows] == ["a", "b", "c"]
    phases = (PREFILL_COMPUTE, KV_TRANSFER, DECODE)
    count = {r.label: {p: sum(b.phase == p for b in r.bars) for p in phases} for r in rows}
    assert count == {
        "a": {PREFILL_COMPUTE: 2, KV_TRANSFER: 4, DECODE: 1},
        "b": {PREFILL_COMPUTE: 3, KV_TRANSFER: 6, DECODE: 1},
        "c": {PREFILL_COMPUTE: 1, KV_TRANSFER: 0, DECODE: 1},
    }
    a = rows[0]
    assert min(b.start for b in a.bars) == T0 + 0.01  # the prefill's first forward
    assert [b.end for b in a.bars if b.phase == DECODE] == [T0 + 0.9]


def test_figure_has_a_bar_per_phase_and_the_file_is_a_png(tmp_path) -> None:
    rows = request_bars(entries())
    fig = timeline_figure(rows)
    (ax,) = fig.axes
    bars = {c.get_label(): len(c.patches) for c in ax.containers}
    assert bars == {PREFILL_COMPUTE: 2 + 3 + 1, KV_TRANSFER: 4 + 6, DECODE: 3}
    assert len(ax.patches) == 6 + 10 + 3
    # every bar sits on its request's row, at its start (ms since the first arrival)
    compute = next(c for c in ax.containers if c.get_label() == PREFILL_COMPUTE)
    assert sorted(round(p.get_x(), 6) for p in compute.patches)[:2] == [0.0, 50.0]  # a's first chunk, b's
    out = plot_timelines(rows, tmp_path / "t" / "timeline.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
