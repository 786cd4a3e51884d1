"""The rows of a sweep's result: one per (prompt length, mode), with the exposed-transfer figures
and, when the link rate and the model's KV size are known, the ideal transfer time.

Exposed transfer time of a PD mode = TTFT(mode) - TTFT(inproc), medians of the same run;
exposed_transfer_ratio of a pipelined mode = its exposed time / the baseline's. The transfer tail
(the prefill's own measure of the KV still landing after the forward) and its ratio say the same
without the compute noise between the processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpipe.bench.serve.sweep import BASELINE, INPROC, SweepPoint, is_pipelined
from kvpipe.transfer.planning.wire_bytes import KVWireBytes


def exposed_ratio(ttft_mode: float | None, ttft_baseline: float | None, ttft_inproc: float | None) -> float | None:
    """(TTFT_mode - TTFT_inproc) / (TTFT_baseline - TTFT_inproc); None when undefined (a missing
    figure, or a baseline that exposes nothing: no transfer to hide)."""
    if ttft_mode is None or ttft_baseline is None or ttft_inproc is None:
        return None
    denom = ttft_baseline - ttft_inproc
    return (ttft_mode - ttft_inproc) / denom if denom > 0 else None


def _get(summary: Mapping[str, Any] | None, key: str) -> Any:
    return None if summary is None else summary.get(key)


def sweep_rows(
    points: Iterable[SweepPoint],
    link_rate_bps: float | None = None,
    kv_wire: KVWireBytes | None = None,
    state_bytes_request: int = 0,
) -> list[dict[str, Any]]:
    """One row per (prompt_len, mode), ordered by prompt length then by the order modes ran.

    With the link rate and the KV size known, a row also states the ideal transfer time of the
    prompt's KV, `kv_wire.request_nbytes(n)` (a sliding-window model sends those layers' window
    only), plus a hybrid model's per-request state, at line rate and its ratio to compute
    (T/C, C = the inproc TTFT)."""
    points = list(points)
    mode_order = list(dict.fromkeys(p.mode for p in points))
    by_key = {(p.prompt_len, p.mode): p for p in points}
    rows = []
    for n in sorted({p.prompt_len for p in points}):
        ref = by_key.get((n, INPROC))
        base = by_key.get((n, BASELINE))
        ttft_inproc = _get(ref.summary if ref else None, "ttft_p50_ms")
        ttft_base = _get(base.summary if base else None, "ttft_p50_ms")
        tail_base = base.transfer_tail_ms if base else None
        kv_bytes = kv_wire.request_nbytes(n) if kv_wire is not None else None
        wire = kv_bytes + state_bytes_request if kv_bytes else None  # the state goes once per request
        t_ms = wire * 8 / link_rate_bps * 1e3 if wire and link_rate_bps else None
        for mode in mode_order:
            p = by_key.get((n, mode))
            if p is None:
                continue
            s = p.summary
            ttft = s.get("ttft_p50_ms")
            exposed = ttft - ttft_inproc if mode != INPROC and None not in (ttft, ttft_inproc) else None
            rows.append(
                {
                    "prompt_len": n,
                    "mode": mode,
                    "ttft_p50_ms": ttft,
                    "ttft_p99_ms": s.get("ttft_p99_ms"),
                    "tpot_p50_ms": s.get("tpot_p50_ms"),
                    "itl_p50_ms": s.get("itl_p50_ms"),
                    "e2e_p50_ms": s.get("e2e_p50_ms"),
                    "output_throughput": s.get("output_throughput"),
                    "completed": s.get("completed"),
                    "failed": s.get("failed"),
                    "num_groups": p.num_groups,
                    "exposed_transfer_ms": exposed,
                    "exposed_transfer_ratio": exposed_ratio(ttft, ttft_base, ttft_inproc)
                    if is_pipelined(mode)
                    else None,
                    "transfer_tail_ms": p.transfer_tail_ms,
                    "transfer_tail_ratio": (
                        p.transfer_tail_ms / tail_base
                        if is_pipelined(mode) and tail_base and p.transfer_tail_ms is not None
                        else None
                    ),
                    "ttft_vs_baseline": ttft / ttft_base - 1 if mode != BASELINE and ttft and ttft_base else None,
                    "ttft_speedup_vs_baseline": ttft_base / ttft if mode != BASELINE and ttft and ttft_base else None,
                    "kv_bytes_per_request": p.kv_bytes_per_request,
                    "cached_tokens_mean": s.get("cached_tokens_mean"),
                    "prompt_tokens_mean": s.get("prompt_tokens_mean"),
                    "kv_bytes": kv_bytes,
                    "state_bytes": state_bytes_request,
                    "ideal_transfer_ms": t_ms,
                    "t_over_c": t_ms / ttft_inproc if t_ms and ttft_inproc else None,
                }
            )
    return rows
