"""Which prefill rank sends which KV heads to which decode rank when the two TP sizes differ.

Rank mapping with P prefill ranks and D decode ranks, decode rank r (docs/architecture.md,
Rank mapping and head slicing):
  D == P -> prefill rank r;  D > P -> prefill rank r // (D/P);
  D < P  -> prefill ranks r*P/D ... (r+1)*P/D - 1, each sending its head slice.
Heads are given as global [start, end) ranges (ParallelConfig: with tp > heads, rank t holds the
replicated head t // (tp / heads)). The slice a pair moves is the intersection of the two ranges,
which reproduces SGLang's head-offset formulas (tests/unit/test_planner.py) without their modulo
pitfalls. When several prefill ranks hold the same replicated head, only the first sends it, so
every decode head is written exactly once (MLA's single latent "head" falls out of the same rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpipe.config import ParallelConfig


@dataclass(frozen=True)
class HeadSlice:
    """Global KV heads [head_start, head_end) that `prefill_rank` writes into `decode_rank`."""

    prefill_rank: int
    decode_rank: int
    head_start: int
    head_end: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def kv_head_range(tp_size: int, tp_rank: int, total_kv_heads: int) -> tuple[int, int]:
    """Global [start, end) KV heads held by one rank (replicated when tp_size > heads)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    pc = ParallelConfig(tp_size=tp_size, tp_rank=tp_rank)
    start = pc.kv_head_start(total_kv_heads)
    return start, start + pc.local_kv_heads(total_kv_heads)


def head_intersection(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def source_ranks(decode_rank: int, prefill_tp: int, decode_tp: int) -> range:
    """Prefill ranks that decode rank `decode_rank` receives from (the mapping above), before de-duplication."""
    if prefill_tp <= 0 or decode_tp <= 0:
        raise ValueError(f"TP sizes must be positive, got prefill {prefill_tp}, decode {decode_tp}")
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise ValueError(f"prefill TP {prefill_tp} and decode TP {decode_tp}: one must divide the other")
    if not 0 <= decode_rank < decode_tp:
        raise ValueError(f"decode rank {decode_rank} outside [0, {decode_tp})")
    if decode_tp >= prefill_tp:
        p = decode_rank // (decode_tp // prefill_tp)
        return range(p, p + 1)
    k = prefill_tp // decode_tp
    return range(decode_rank * k, (decode_rank + 1) * k)


def slices_for_decode_rank(decode_rank: int, prefill_tp: int, decode_tp: int, total_kv_heads: int) -> list[HeadSlice]:
    """The slices decode rank `decode_rank` receives; together they cover its heads exactly once."""
    dst = kv_head_range(decode_tp, decode_rank, total_kv_heads)
    out: list[HeadSlice] = []
    seen: set[tuple[int, int]] = set()
    for p in source_ranks(decode_rank, prefill_tp, decode_tp):
        inter = head_intersection(kv_head_range(prefill_tp, p, total_kv_heads), dst)
        # Aligned partitions: two intersections are equal (replicated head) or disjoint.
        if inter is None or inter in seen:
            continue
        seen.add(inter)
        out.append(HeadSlice(p, decode_rank, *inter))
    covered = sum(s.num_heads for s in out)
    if covered != dst[1] - dst[0]:
        raise ValueError(
            f"decode rank {decode_rank} heads {dst} covered {covered} times by "
            f"prefill TP {prefill_tp} (total KV heads {total_kv_heads})"
        )
    return out


def transfer_slices(prefill_tp: int, decode_tp: int, total_kv_heads: int) -> list[HeadSlice]:
    """Every (prefill rank, decode rank, heads) triple of one request, decode-rank-major."""
    return [s for r in range(decode_tp) for s in slices_for_decode_rank(r, prefill_tp, decode_tp, total_kv_heads)]
