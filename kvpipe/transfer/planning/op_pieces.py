"""Write ops -> pieces sized for the transport, vectorised with numpy (no loop over ops).

Why: the planner coalesces a contiguous page run into one op per (layer, K/V) buffer, which is
right for op counts (each op costs ~11 us in Mooncake's submit path) but one op rides one TCP
lane of Mooncake's transport. Pieces of about a MiB, several in flight, use its lanes in
parallel (docs/benchmarks.md, raw piece x window sweep). The Mooncake backend splits at submit,
so plans stay in planned ops and only the wire sees pieces.
"""

from __future__ import annotations

import numpy as np


def piece_counts(length: np.ndarray, max_bytes: int) -> np.ndarray:
    """[N] pieces per op: ceil(length / max_bytes); 0 for an empty op."""
    if max_bytes <= 0:
        raise ValueError(f"piece size must be positive, got {max_bytes}")
    return -(-np.asarray(length, dtype=np.int64) // max_bytes)


def split_ops(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ops [N] -> pieces [P], P = sum(ceil(length / max_bytes)), all int64.

    Op i becomes pieces of `max_bytes` at offsets 0, max_bytes, ... of both its source and its
    destination, the last one shorter; pieces keep op order and empty ops vanish. When no op is
    longer than `max_bytes` the inputs come back as they are (no copy).
    """
    s, d, n = (np.asarray(x, dtype=np.int64).ravel() for x in (src, dst, length))
    if not s.shape == d.shape == n.shape:
        raise ValueError(f"op arrays differ in length: {s.size}, {d.size}, {n.size}")
    if n.size and n.min() < 0:
        raise ValueError("op lengths must not be negative")
    counts = piece_counts(n, max_bytes)  # [N]
    if (counts == 1).all():
        return s, d, n
    total = int(counts.sum())
    first = np.cumsum(counts) - counts  # [N] index of each op's first piece
    # [P] byte offset of each piece inside its op: (piece index - its op's first piece) * max_bytes
    offset = (np.arange(total, dtype=np.int64) - np.repeat(first, counts)) * max_bytes
    return (
        np.repeat(s, counts) + offset,
        np.repeat(d, counts) + offset,
        np.minimum(np.repeat(n, counts) - offset, max_bytes),
    )
