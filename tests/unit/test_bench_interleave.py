"""Interleaved sweeps (all stacks at once, modes alternating round by round) and the prefill's
transfer tail (KV still landing after the forward) from probe to rows and plot."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvpipe.bench.rotation import rotated
from kvpipe.bench.serve.plot import plot_sweep
from kvpipe.bench.serve.sweep import (
    ModeFlags,
    SliceResult,
    SweepPoint,
    colocated_flags,
    mode_server_flags,
    parse_modes,
    run_sweep_in_rounds,
    run_sweep_interleaved,
)
from kvpipe.bench.serve.sweep_rows import sweep_rows
from kvpipe.harness.probe import (
    TransferCount,
    count_delta,
    tail_delta,
    transfer_count_from_server_info,
    transfer_tail_from_server_info,
)
from kvpipe.transfer.planning.wire_bytes import KVWireBytes
from tests.helpers.sweep_stacks import recording_stacks


def test_rotation():
    modes = ["inproc", "baseline", "pipelined"]
    assert [rotated(modes, r)[0] for r in range(4)] == ["inproc", "baseline", "pipelined", "inproc"]
    assert sorted(rotated(modes, 5)) == sorted(modes) and rotated(("a", "b"), 1) == ["b", "a"]
    assert rotated([], 3) == []


def test_interleaved_sweep_alternates_modes_and_merges_rounds():
    events: list[tuple] = []

    open_stack = recording_stacks(events)

    def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
        events.append((mode, n, r))
        groups = None if mode == "a" else r + 1  # the last round's count is reported
        return SliceResult([(mode, n, r)], 0.5, groups, None if mode == "a" else [30.0, 10.0, 90.0][r])

    def summarize(records, duration_s):
        return {"records": list(records), "duration_s": duration_s}

    points = run_sweep_interleaved([10, 20], ["a", "b"], open_stack, measure, 3, summarize)
    assert events[:2] == [("start", "a"), ("start", "b")] and events[-2:] == [("stop", "b"), ("stop", "a")]
    assert events[2:-2] == [
        ("a", 10, 0),
        ("b", 10, 0),
        ("b", 10, 1),
        ("a", 10, 1),
        ("a", 10, 2),
        ("b", 10, 2),
        ("a", 20, 0),
        ("b", 20, 0),
        ("b", 20, 1),
        ("a", 20, 1),
        ("a", 20, 2),
        ("b", 20, 2),
    ]
    assert [(p.prompt_len, p.mode, p.num_groups) for p in points] == [
        (10, "a", None),
        (10, "b", 3),
        (20, "a", None),
        (20, "b", 3),
    ]
    assert points[1].summary == {"records": [("b", 10, 0), ("b", 10, 1), ("b", 10, 2)], "duration_s": 1.5}
    assert points[1].transfer_tail_ms == 30.0 and points[0].transfer_tail_ms is None  # median of rounds


def test_interleaved_sweep_stops_every_stack_on_failure():
    stopped = []

    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        try:
            yield mode
        finally:
            stopped.append(mode)

    def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
        raise RuntimeError("server died")

    with pytest.raises(RuntimeError):
        run_sweep_interleaved([1], ["a", "b"], open_stack, measure, 2, lambda recs, d: {})
    assert stopped == ["b", "a"]
    with pytest.raises(ValueError):
        run_sweep_interleaved([1], ["a"], open_stack, measure, 0, lambda recs, d: {})


def test_transfer_tail_probe_rows_and_plot(tmp_path):
    info = {"internal_states": [{"num_groups": 4, "transfer_tail_ms_sum": 900.0, "transfer_tail_count": 3}]}
    assert transfer_tail_from_server_info(info) == (900.0, 3)
    assert transfer_tail_from_server_info({"internal_states": [{"free_pages": 1}]}) is None
    assert tail_delta((900.0, 3), (1500.0, 5)) == pytest.approx(300.0)
    assert tail_delta((900.0, 3), (900.0, 3)) is None and tail_delta(None, (1.0, 1)) is None

    def s(ttft):
        return {"ttft_p50_ms": ttft, "ttft_p99_ms": ttft, "completed": 3, "failed": 0}

    points = [
        SweepPoint(2048, "inproc", s(1000.0)),
        SweepPoint(2048, "baseline", s(2000.0), 1, 960.0),
        SweepPoint(2048, "pipelined", s(1200.0), 6, 180.0),
    ]
    rows = {r["mode"]: r for r in sweep_rows(points, 1e8, KVWireBytes(1000))}
    assert rows["pipelined"]["transfer_tail_ms"] == 180.0
    assert rows["pipelined"]["transfer_tail_ratio"] == pytest.approx(0.1875)  # 180 / 960 <= 1.5 / 6
    assert rows["baseline"]["transfer_tail_ratio"] is None and rows["inproc"]["transfer_tail_ms"] is None
    out = plot_sweep(list(rows.values()), tmp_path / "sweep.png")
    assert out.stat().st_size > 1000


def test_transferred_kv_per_request_from_probe_to_rows():
    """The prefill's bytes_written / rooms_succeeded, read before and after each round, give the
    KV bytes per request of a mode; rows carry it with the TTFT speedup against baseline."""
    info = {"internal_states": [{"disaggregation": {"mode": "prefill", "bytes_written": 4096, "rooms_succeeded": 3}}]}
    assert transfer_count_from_server_info(info) == TransferCount(4096, 3)
    assert transfer_count_from_server_info({"internal_states": [{"disaggregation": {"mode": "decode"}}]}) is None
    assert count_delta(TransferCount(100, 1), TransferCount(700, 4)) == TransferCount(600, 3)
    assert count_delta(None, TransferCount(1, 1)) is None and TransferCount(5, 0).per_room is None

    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        yield mode

    def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
        per = {"baseline": 1000, "decode-cache": 100}[mode]
        return SliceResult([], 1.0, transfer=TransferCount(per * (r + 1), r + 1))

    points = run_sweep_interleaved(
        [64],
        ["baseline", "decode-cache"],
        open_stack,
        measure,
        2,
        lambda recs, d: {"ttft_p50_ms": 400.0 if len(recs) == 0 else None},
    )
    assert [p.kv_bytes_per_request for p in points] == [1000.0, 100.0]
    points = [
        SweepPoint(64, "baseline", {"ttft_p50_ms": 400.0, "cached_tokens_mean": 32.0}, kv_bytes_per_request=1e3),
        SweepPoint(64, "decode-cache", {"ttft_p50_ms": 100.0}, kv_bytes_per_request=1e2),
    ]
    rows = sweep_rows(points)
    assert rows[1]["ttft_speedup_vs_baseline"] == 4.0 and rows[0]["ttft_speedup_vs_baseline"] is None
    assert rows[1]["kv_bytes_per_request"] == 100.0 and rows[0]["cached_tokens_mean"] == 32.0


def test_recording_modes_and_per_round_throughput():
    """pd-norecord / inproc-norecord (issue 29: recording on vs off, same run): their flags, and
    each round's output throughput kept in order so the on/off ratio's spread can be read."""
    assert parse_modes("pd,pd-norecord") == ["pd", "pd-norecord"]
    assert mode_server_flags("pd-norecord") == ModeFlags(("--disable-request-metrics",))
    assert mode_server_flags("inproc-norecord") is None
    assert colocated_flags("inproc-norecord") == ("--disable-request-metrics",)

    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        yield mode

    def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
        return SliceResult([mode] * (r + 1), 2.0 if mode == "pd" else 1.0)

    def summarize(records, duration_s):
        return {"output_throughput": 10 * len(records) / duration_s}

    points = run_sweep_interleaved([8], ["pd", "pd-norecord"], open_stack, measure, 3, summarize)
    assert [p.round_throughput for p in points] == [(5.0, 10.0, 15.0), (10.0, 20.0, 30.0)]
    assert points[0].summary == {"output_throughput": 10.0}  # 60 tokens in 6 s


def test_sequential_rounds_send_what_interleaved_sends_one_stack_at_a_time():
    """--compare-colocated without --interleave: each mode gets the same (prompt length, round)
    slices as interleaved, its stack alone (started, all its rounds, stopped), and the same points."""

    def run(sweep):
        events: list[tuple] = []

        open_stack = recording_stacks(events)

        def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
            events.append((mode, n, r))
            return SliceResult(
                [(mode, n, r)], 0.5 + r, None if mode == "a" else r + 1, None if mode == "a" else 10.0 * r
            )

        def summarize(records, duration_s):
            return {"records": list(records), "duration_s": duration_s}

        return sweep([10, 20], ["a", "b"], open_stack, measure, 2, summarize), events

    seq, seq_events = run(run_sweep_in_rounds)
    inter, inter_events = run(run_sweep_interleaved)
    assert seq_events == [
        ("start", "a"),
        *[("a", n, r) for n in (10, 20) for r in (0, 1)],
        ("stop", "a"),
        ("start", "b"),
        *[("b", n, r) for n in (10, 20) for r in (0, 1)],
        ("stop", "b"),
    ]
    assert sorted(e for e in seq_events if len(e) == 3) == sorted(e for e in inter_events if len(e) == 3)
    key = lambda p: (p.prompt_len, p.mode)  # noqa: E731
    assert sorted(seq, key=key) == sorted(inter, key=key)
    assert [p.summary["duration_s"] for p in seq] == [2.0] * 4 and seq[2].num_groups == 2
    with pytest.raises(ValueError):
        run_sweep_in_rounds([10], ["a"], contextlib.nullcontext, lambda *a: SliceResult([], 0.0), 0, dict)
