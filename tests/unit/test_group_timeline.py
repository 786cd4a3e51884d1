"""bench/serve/group_timeline.py: a prefill's per-layer-group timeline from its /debug/requests entry."""

from __future__ import annotations

import pytest

from kvpipe.bench.serve.group_timeline import (
    format_group_timeline,
    group_timeline,
    newest_group_timeline,
    with_planner,
)
from kvpipe.harness.probe import layer_group_estimates_from_server_info


def _entry(events: list[tuple[str, float, int | None]]) -> dict:
    return {
        "rid": "r",
        "timeline": {
            "arrived_monotonic": 100.0,
            "events": [{"phase": p, "t": t, **({} if v is None else {"value": v})} for p, t, v in events],
        },
    }


PIPELINED = _entry(
    [
        ("arrived", 0.0, None),
        ("forward_start", 0.010, 2048),
        ("layer_group_done", 0.110, 1),
        ("transfer_start", 0.112, None),
        ("layer_group_done", 0.310, 3),
        ("transfer_done", 0.320, None),
        ("transfer_start", 0.321, None),
        ("layer_group_done", 0.410, 4),
        ("forward_end", 0.412, 2048),
        ("transfer_done", 0.560, None),
    ]
)


def test_groups_stretches_and_tail_in_ms_since_the_forward():
    g = group_timeline(PIPELINED["timeline"])
    assert g is not None
    assert g.groups == ((1, pytest.approx(100.0)), (3, pytest.approx(300.0)), (4, pytest.approx(400.0)))
    assert g.forward_end_ms == pytest.approx(402.0)
    assert g.stretches == ((pytest.approx(102.0), pytest.approx(310.0)), (pytest.approx(311.0), pytest.approx(550.0)))
    assert g.tail_ms == pytest.approx(148.0)  # the last write finished 148 ms after the forward
    text = format_group_timeline("pipelined len=2048", g)
    assert "3 layer groups" in text and "L3@300" in text and "left after the forward: 148 ms" in text


def test_plain_path_and_empty_entries_have_no_group_timeline():
    plain = _entry([("forward_start", 0.0, 10), ("forward_end", 0.1, 10), ("transfer_start", 0.1, None)])
    assert group_timeline(plain["timeline"]) is None
    assert newest_group_timeline([]) is None
    # the newest entry that pipelined, not the newest entry
    assert newest_group_timeline([PIPELINED, plain]) == group_timeline(PIPELINED["timeline"])


def test_no_writes_recorded_keeps_the_groups():
    g = group_timeline(
        _entry([("forward_start", 0.0, 8), ("layer_group_done", 0.05, 2), ("forward_end", 0.1, 8)])["timeline"]
    )
    assert g is not None and g.stretches == () and g.tail_ms is None
    assert "none recorded" in format_group_timeline("x", g)


def test_planner_estimates_from_server_info():
    groups = {"num_groups": 8, "compute_ms": 2900.4, "transfer_ms": 2650.0, "predicted_ms": None}
    info = {"internal_states": [{"disaggregation": {"mode": "prefill", "layer_groups": groups}}]}
    assert layer_group_estimates_from_server_info(info) == {"compute_ms": 2900.4, "transfer_ms": 2650.0}
    assert layer_group_estimates_from_server_info({"internal_states": [{}]}) == {}
    g = group_timeline(PIPELINED["timeline"])
    assert g is not None
    assert with_planner(g, None).planner == {}  # the server was unreachable
    text = format_group_timeline("x", with_planner(g, info))
    assert "planner's estimates (ms): compute 2900, transfer 2650" in text
    assert "planner" not in format_group_timeline("x", g)
