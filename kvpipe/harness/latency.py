"""Latency statistics of a serving run from streaming event timestamps (pure functions).

An `Outcome` (kvpipe/harness/outcome.py) is what the driver saw of one request: when it was sent,
and for every stream event that brought new output tokens the arrival time and the cumulative
token count.

  TTFT = first token event - send time
  e2e  = end of the stream - send time
  TPOT = (last token event - first token event) / (output tokens - 1)    (needs >= 2 tokens)
  ITL  = gaps between consecutive token events; an event carrying k new tokens contributes
         k entries of gap / k (SGLang's bench_serving convention), so every token but the
         first has exactly one ITL entry.
Times are seconds in records and milliseconds in the summary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpipe.harness.outcome import Outcome

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    tpot_s: float | None  # None for single-token outputs
    itl_s: tuple[float, ...]
    prompt_len: int | None  # prompt tokens, the server's count where it reported one (Outcome.prompt_tokens)
    output_tokens: int


def request_metrics(rec: Outcome) -> RequestMetrics:
    """Per-request figures of a successful request (raises ValueError for a failed one)."""
    if not rec.ok or not rec.token_counts:
        raise ValueError(f"request {rec.index} has no tokens: {rec.reason or 'empty stream'}")
    times, counts = rec.token_times, rec.token_counts
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"request {rec.index}: event times go backwards")
    ttft = times[0] - rec.start_s
    end = rec.end_s
    n = counts[-1]
    tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else None
    itl: list[float] = []
    for (t0, c0), (t1, c1) in zip(zip(times, counts), zip(times[1:], counts[1:])):
        k = c1 - c0
        itl.extend([(t1 - t0) / k] * k)
    return RequestMetrics(ttft, end - rec.start_s, tpot, tuple(itl), rec.prompt_tokens, n)


def completed_metrics(records: Sequence[Outcome]) -> list[RequestMetrics]:
    """The figures of the requests that completed with tokens (the rest count as failed)."""
    return [request_metrics(r) for r in records if r.ok and r.token_counts]


def percentiles(values: Sequence[float], ps: Iterable[int] = PERCENTILES) -> dict[int, float | None]:
    """Linear-interpolated percentiles (numpy's default); None for every p when `values` is empty."""
    ps = tuple(ps)
    if len(values) == 0:
        return {p: None for p in ps}
    got = np.percentile(np.asarray(values, dtype=np.float64), ps)
    return {p: float(v) for p, v in zip(ps, got)}


def _stat_block(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values_s]
    out: dict[str, float | None] = {f"{name}_mean_ms": float(np.mean(ms)) if ms else None}
    for p, v in percentiles(ms).items():
        out[f"{name}_p{p}_ms"] = v
    return out


def summarize(records: Sequence[Outcome], duration_s: float) -> dict[str, float | int | None]:
    """Run-level statistics: counts, throughput over `duration_s`, and latency percentiles (ms)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = completed_metrics(records)
    out_tokens = sum(m.output_tokens for m in done)
    in_tokens = sum(m.prompt_len for m in done if m.prompt_len is not None)
    counted = sum(m.prompt_len is not None for m in done)
    summary: dict[str, float | int | None] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "input_throughput": in_tokens / duration_s,
        "output_throughput": out_tokens / duration_s,
    }
    summary |= _stat_block("ttft", [m.ttft_s for m in done])
    summary |= _stat_block("tpot", [m.tpot_s for m in done if m.tpot_s is not None])
    summary |= _stat_block("itl", [x for m in done for x in m.itl_s])
    summary |= _stat_block("e2e", [m.e2e_s for m in done])
    cached = [r.cached_tokens for r in records if r.ok and r.cached_tokens is not None]
    summary["prompt_tokens_mean"] = in_tokens / counted if counted else None
    if counted < len(done):  # text prompts the server gave no token count for: not in the input totals
        summary["prompt_tokens_unreported"] = len(done) - counted
    summary["cached_tokens_mean"] = float(np.mean(cached)) if cached else None
    return summary


def first_errors(records: Sequence[Outcome], limit: int = 3) -> list[str]:
    """A few distinct reasons of failed requests, for the report."""
    seen: list[str] = []
    for r in records:
        msg = (r.reason or r.end.value) if not r.ok else None if r.token_counts else "stream ended without tokens"
        if msg and msg not in seen:
            seen.append(msg)
            if len(seen) == limit:
                break
    return seen
