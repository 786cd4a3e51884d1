"""Latency statistics from hand-made event timestamps (no clocks, no servers)."""

from __future__ import annotations

import pytest

from kvpipe.harness.latency import first_errors, percentiles, request_metrics, summarize
from kvpipe.harness.outcome import End, Outcome
from kvpipe.harness.request import Request


def rec(
    index: int,
    start: float,
    events: list[tuple[float, int]],
    end: float | None = None,
    prompt_len: int = 10,
    error: str | None = None,
) -> Outcome:
    """An outcome with these token events (times, cumulative counts); it ends at `end`, else at
    its last event; `error` makes it a failure."""
    times = tuple(t for t, _ in events)
    last = end if end is not None else (times[-1] if times else start)
    return Outcome(
        Request(index, (1,) * prompt_len, events[-1][1] if events else 1),
        End.OK if error is None else End.CUT,
        start,
        last,
        prompt_len,
        reason=error or "",
        token_times=times,
        token_counts=tuple(n for _, n in events),
    )


def test_single_token_per_event() -> None:
    m = request_metrics(rec(0, 1.0, [(1.5, 1), (1.6, 2), (1.8, 3)], end=1.9))
    assert m.ttft_s == pytest.approx(0.5)
    assert m.e2e_s == pytest.approx(0.9)
    assert m.tpot_s == pytest.approx(0.15)  # (1.8 - 1.5) / 2
    assert m.itl_s == pytest.approx((0.1, 0.2))
    assert m.output_tokens == 3


def test_multi_token_events_spread_itl() -> None:
    r = rec(0, 0.0, [(0.2, 1), (0.5, 4), (0.6, 5)])
    m = request_metrics(r)
    assert m.itl_s == pytest.approx((0.1, 0.1, 0.1, 0.1))  # 0.3 over 3 tokens, then 0.1
    assert len(m.itl_s) == m.output_tokens - 1
    assert m.tpot_s == pytest.approx(0.1)
    assert m.e2e_s == pytest.approx(0.6)  # no end time: the last token event


def test_single_token_output_has_no_tpot() -> None:
    m = request_metrics(rec(0, 0.0, [(0.3, 1)]))
    assert m.tpot_s is None and m.itl_s == () and m.ttft_s == pytest.approx(0.3)


def test_failed_and_backwards_records_raise() -> None:
    with pytest.raises(ValueError):
        request_metrics(rec(0, 0.0, [], error="HTTP 500"))
    with pytest.raises(ValueError):
        request_metrics(rec(0, 0.0, [(0.5, 1), (0.4, 2)]))


def test_percentiles() -> None:
    assert percentiles([]) == {50: None, 90: None, 99: None}
    p = percentiles(list(range(1, 101)))
    assert p[50] == pytest.approx(50.5) and p[90] == pytest.approx(90.1) and p[99] == pytest.approx(99.01)
    assert percentiles([7.0], (50, 99)) == {50: 7.0, 99: 7.0}


def test_summarize_counts_throughput_and_ms() -> None:
    records = [
        rec(0, 0.0, [(0.1, 1), (0.2, 2)], prompt_len=8),
        rec(1, 0.0, [(0.3, 1), (0.5, 2), (0.7, 3)], prompt_len=16),
        rec(2, 0.0, [], error="timeout"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["total_output_tokens"] == 5 and s["total_input_tokens"] == 24
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)  # median of 100 and 300 ms
    assert s["ttft_mean_ms"] == pytest.approx(200.0)
    assert s["tpot_p50_ms"] == pytest.approx(150.0)  # median of 100 and 200
    assert s["itl_p50_ms"] == pytest.approx(200.0)  # [100, 200, 200]
    assert s["e2e_p99_ms"] == pytest.approx(200 + 0.99 * 500)
    assert first_errors(records) == ["timeout"]
    with pytest.raises(ValueError):
        summarize(records, duration_s=0.0)


def test_summarize_all_failed_gives_nulls() -> None:
    s = summarize([rec(0, 0.0, [], error="x"), rec(1, 0.0, [])], duration_s=1.0)
    assert s["completed"] == 0 and s["ttft_p50_ms"] is None and s["tpot_mean_ms"] is None
    assert first_errors([rec(0, 0.0, [], error="x"), rec(1, 0.0, [])]) == ["x", "stream ended without tokens"]
    assert first_errors([rec(0, 0.0, [], error="")]) == ["cut"]  # no reason: how it ended
