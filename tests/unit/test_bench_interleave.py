"""Interleaved sweeps: all stacks at once, modes alternating round by round (rotated order)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

from kvpipe.bench.sweep import SliceResult, round_order, run_sweep_interleaved


def test_round_order_rotates():
    modes = ["inproc", "baseline", "pipelined"]
    assert [round_order(modes, r)[0] for r in range(4)] == ["inproc", "baseline", "pipelined", "inproc"]
    assert sorted(round_order(modes, 5)) == sorted(modes)


def test_interleaved_sweep_alternates_modes_and_merges_rounds():
    events: list[tuple] = []

    @contextlib.contextmanager
    def open_stack(mode: str) -> Iterator[str]:
        events.append(("start", mode))
        try:
            yield f"url-{mode}"
        finally:
            events.append(("stop", mode))

    def measure(ep: str, mode: str, n: int, r: int) -> SliceResult:
        events.append((mode, n, r))
        groups = None if mode == "a" else r + 1  # the last round's count is reported
        return SliceResult([(mode, n, r)], 0.5, groups)

    def summarize(records, duration_s):
        return {"records": list(records), "duration_s": duration_s}

    points = run_sweep_interleaved([10, 20], ["a", "b"], open_stack, measure, 3, summarize)
    assert events[:2] == [("start", "a"), ("start", "b")] and events[-2:] == [("stop", "b"), ("stop", "a")]
    assert events[2:-2] == [("a", 10, 0), ("b", 10, 0), ("b", 10, 1), ("a", 10, 1), ("a", 10, 2), ("b", 10, 2),
                            ("a", 20, 0), ("b", 20, 0), ("b", 20, 1), ("a", 20, 1), ("a", 20, 2), ("b", 20, 2)]
    assert [(p.prompt_len, p.mode, p.num_groups) for p in points] == [(10, "a", None), (10, "b", 3),
                                                                     (20, "a", None), (20, "b", 3)]
    assert points[1].summary == {"records": [("b", 10, 0), ("b", 10, 1), ("b", 10, 2)], "duration_s": 1.5}


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
