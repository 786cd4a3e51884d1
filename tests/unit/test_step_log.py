"""The engine's periodic speed lines (kvpipe/engine/step_log.py): SGLang's format, what each field
counts, the decode interval, and the speed over the time the steps ran."""

from __future__ import annotations

import re

import pytest

from kvpipe.engine.batch import ForwardMode, ScheduledBatch
from kvpipe.engine.request import Req, SamplingParams
from kvpipe.engine.step_log import Occupancy, SpecTotals, StepLog

STATS = {"num_running": 3, "num_waiting": 2, "used_pages": 10, "total_pages": 40, "page_size": 16}


def req(n: int, cached: int = 0) -> Req:
    r = Req(f"r{n}-{cached}", list(range(n)), SamplingParams())
    r.cached_tokens = cached
    return r


def test_prefill_line_counts_new_tokens_and_first_chunk_hits() -> None:
    a, b = req(100, cached=32), req(300, cached=0)
    # a: its first chunk after a 32-token hit; b: its second chunk (prefix 128 = its own first chunk)
    batch = ScheduledBatch(ForwardMode.PREFILL, [a, b], [68, 128], [32, 128])
    line = StepLog(40).after_step(batch, 1, 0.5, lambda: STATS, None)
    assert line == (
        "Prefill batch. #new-seq: 2, #new-token: 196, #cached-token: 32, token usage: 0.25, "
        "#running-req: 3, #queue-req: 2"
    )


def decode_batch(rows: int) -> ScheduledBatch:
    return ScheduledBatch(ForwardMode.DECODE, [req(8) for _ in range(rows)], [1] * rows, [8] * rows)


def test_decode_line_every_interval_steps_with_the_rate_over_busy_time() -> None:
    log = StepLog(4)
    lines = [log.after_step(decode_batch(2), 2, 0.25, lambda: STATS, None) for _ in range(8)]
    assert [i for i, line in enumerate(lines) if line] == [3, 7]
    # 4 steps of 2 tokens in 4 x 0.25 s of steps: 8 tokens/s, however long the engine sat idle between
    assert lines[3] == (
        "Decode batch. #running-req: 3, #token: 160, token usage: 0.25, gen throughput (token/s): 8.00, #queue-req: 2"
    )
    assert log.generated == 16


def test_accept_length_is_over_the_interval() -> None:
    log = StepLog(2)
    log.after_step(decode_batch(1), 3, 0.1, lambda: STATS, SpecTotals(1, 3))
    first = log.after_step(decode_batch(1), 1, 0.1, lambda: STATS, SpecTotals(2, 4))
    log.after_step(decode_batch(1), 2, 0.1, lambda: STATS, SpecTotals(3, 6))
    second = log.after_step(decode_batch(1), 2, 0.1, lambda: STATS, SpecTotals(4, 8))
    assert first is not None and "accept len: 2.00" in first  # 4 tokens in 2 verify steps
    assert second is not None and "accept len: 2.00" in second  # (8 - 4) / (4 - 2)
    assert re.search(r"accept len: [\d.]+, gen throughput", second)


def test_interval_zero_logs_nothing_but_still_counts() -> None:
    log = StepLog(0)
    prefill = ScheduledBatch(ForwardMode.PREFILL, [req(10)], [10], [0])
    assert log.after_step(prefill, 1, 0.1, lambda: STATS, None) is None
    assert all(log.after_step(decode_batch(1), 1, 0.1, lambda: STATS, None) is None for _ in range(100))
    assert log.generated == 101


def test_occupancy_and_bad_interval() -> None:
    assert Occupancy.of(STATS) == Occupancy(3, 2, 10, 40, 16)
    assert Occupancy(0, 0, 0, 0, 16).token_usage == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        StepLog(-1)
