"""`bench serve --compare-colocated` bookkeeping without servers: the PD mode, rows, ratios, table."""

from __future__ import annotations

import pytest

from kvpipe.bench.serve.compare import COMPARE_MODES, compare_rows, compare_table
from kvpipe.bench.serve.sweep import ModeFlags, SweepPoint, mode_server_flags, parse_modes


def summary(e2e50: float, ttft50: float) -> dict:
    return {
        "e2e_p50_ms": e2e50,
        "e2e_p90_ms": e2e50 * 1.5,
        "ttft_p50_ms": ttft50,
        "ttft_p90_ms": None,
        "tpot_p50_ms": 6.0,
        "completed": 32,
        "failed": 0,
    }


def test_pd_mode_is_the_launch_defaults() -> None:
    assert COMPARE_MODES == ("pd", "inproc")
    assert parse_modes("pd,inproc") == ["pd", "inproc"]
    assert mode_server_flags("pd") == ModeFlags(())  # nothing beyond what `kvpipe launch` passes


def test_rows_pair_pd_with_colocated_per_prompt_len() -> None:
    points = [
        SweepPoint(362, "pd", summary(360.0, 150.0)),
        SweepPoint(362, "inproc", summary(300.0, 100.0)),
        SweepPoint(1024, "inproc", summary(900.0, 300.0)),
        SweepPoint(1024, "pd", summary(990.0, 450.0)),
        SweepPoint(64, "pd", summary(1.0, 1.0)),
    ]  # no colocated point: no row
    rows = compare_rows(points)
    assert [r["prompt_len"] for r in rows] == [362, 1024]
    r = rows[0]
    assert r["pd"]["e2e_p50_ms"] == 360.0 and r["colocated"]["ttft_p50_ms"] == 100.0
    assert r["ratio"]["e2e_p50_ms"] == pytest.approx(1.2)
    assert r["ratio"]["e2e_p90_ms"] == pytest.approx(1.2)
    assert r["ratio"]["ttft_p50_ms"] == pytest.approx(1.5)
    assert r["ratio"]["ttft_p90_ms"] is None  # a missing figure has no ratio
    assert (r["pd"]["completed"], r["colocated"]["failed"]) == (32, 0)


def test_table() -> None:
    rows = compare_rows(
        [SweepPoint(362, "pd", summary(360.0, 150.0)), SweepPoint(362, "inproc", summary(300.0, 100.0))]
    )
    one = {"total": 1, "affinity": [0]}
    text = compare_table(
        rows, {"prefill": one, "decode": {"total": 1, "affinity": [1]}, "colocated": {"total": 2, "affinity": [0, 1]}}
    )
    lines = text.splitlines()
    assert lines[0] == "prompt 362 tokens (ms)"
    assert "PD (prefill 1 thr, cores 0; decode 1 thr, cores 1)" in lines[2] and "360" in lines[2]
    assert lines[3].startswith("colocated (2 thr, cores 0,1)")
    assert "1.20x" in lines[4] and "1.50x" in lines[4] and lines[4].rstrip().endswith("1.00x")
    assert "PD (prefill ?; decode ?)" in compare_table(rows, {})  # servers that did not report
