"""`python -m kvpipe.bench.engine.linear_kernels` runs every kernel on each shape and row count and prints
a row per point (what it measures is docs/benchmarks.md's; here only that it runs and reports)."""

from __future__ import annotations

import pytest

from kvpipe.bench.engine import linear_kernels
from kvpipe.model.cpu.kernels.weight_only import weight_only_kernels


def test_reports_every_point(capsys) -> None:
    if weight_only_kernels() is None:
        pytest.skip("the C++ kernels are not built")
    linear_kernels.main(["--shapes", "70x32,64x96", "--rows", "1,7", "--repeat", "1", "--bytes", "2e4"])
    lines = capsys.readouterr().out.splitlines()
    assert "fp32 panels" in lines[1] and "int8 rows" in lines[1]
    points = [line.split() for line in lines[2:]]
    assert [(p[0], p[1]) for p in points] == [("70x32", "1"), ("70x32", "7"), ("64x96", "1"), ("64x96", "7")]
    for p in points:  # a rate per kernel (and at one row its bytes per second in parentheses)
        rates = [cell for cell in p[2:] if not cell.startswith("(")]
        assert len(rates) == 7 and all(float(r) >= 0 for r in rates)
        assert len(p[2:]) == (14 if p[1] == "1" else 7)
