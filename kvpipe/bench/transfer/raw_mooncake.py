"""Raw Mooncake write patterns for `kvpipe bench transfer`: the engine driven directly, no kvpipe.

A pattern moves one contiguous range as pieces of `piece_bytes` with up to `window` in flight,
the loop a hand-tuned client would write: submit up to the window, reap from the oldest, sleep
between polls (Mooncake's blocking waits busy-spin a core). One op of all the bytes is the
pattern (piece = whole range, window 1).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.planning.op_pieces import split_ops

_BAD_BATCH_IDS = (0, -1, (1 << 64) - 1)  # a failed submit, as pybind returns it
WHOLE = 0  # piece_bytes of the one-op pattern: the whole range in one op


@dataclass(frozen=True)
class RawPattern:
    piece_bytes: int  # WHOLE (0): one op of all the bytes
    window: int  # pieces in flight

    @property
    def label(self) -> str:
        return "1 op" if self.piece_bytes == WHOLE else f"{fmt_bytes(self.piece_bytes)} x w{self.window}"


def fmt_bytes(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def parse_bytes(text: str) -> int:
    """'64K', '1M', '1048576' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if scale > 1 else t) * scale


def pattern_ops(src: int, dst: int, nbytes: int, pattern: RawPattern) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[P] pieces of the range [src, src + nbytes) -> [dst, dst + nbytes) for this pattern."""
    one = (np.array([src]), np.array([dst]), np.array([nbytes]))
    return one if pattern.piece_bytes == WHOLE else split_ops(*one, pattern.piece_bytes)


def raw_write(
    engine,
    peer: str,
    src: np.ndarray,
    dst: np.ndarray,
    length: np.ndarray,
    window: int,
    poll_interval_s: float = 100e-6,
    timeout_s: float = 300.0,
) -> None:
    """Write every piece with at most `window` in flight; raise if one fails or time runs out."""
    s, d, n = src.tolist(), dst.tolist(), length.tolist()
    inflight: collections.deque[int] = collections.deque()
    cursor, deadline = 0, time.monotonic() + timeout_s
    while cursor < len(n) or inflight:
        while cursor < len(n) and len(inflight) < window:
            bid = engine.transfer_submit_write(peer, s[cursor], d[cursor], n[cursor])
            if bid in _BAD_BATCH_IDS:
                raise RuntimeError(f"raw submit of piece {cursor} to {peer} failed")
            inflight.append(bid)
            cursor += 1
        while inflight:  # pieces mostly land in order: reap up to the first pending one
            rc = engine.transfer_check_status(inflight[0])
            if rc == 0:
                break
            if rc < 0:
                raise RuntimeError(f"raw write to {peer} failed (status {rc})")
            inflight.popleft()
        if inflight and (cursor == len(n) or len(inflight) >= window):
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw write to {peer} timed out with {len(inflight)} pieces in flight")
            time.sleep(poll_interval_s)
