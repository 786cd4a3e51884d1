"""Checks of a window page table: the sliding-window layers' pages of a request (layout.py).

A window table is aligned with the request's full page table by logical page; entry -1 means no
page there for the sliding layers (slid out of the window and freed, or never needed). Both tables
take ids from one allocator and the pool may alias a sliding layer's buffer with a full layer's,
so on an aliased pool a window page must never also be one of the request's full pages.
"""

from __future__ import annotations

import numpy as np


def window_pages_problem(
    swa: np.ndarray, num_pages: int, full: np.ndarray, *, exact: bool, aliased: bool
) -> str | None:
    """Why `swa` ([n] int64) is not a valid window table next to the full table `full`, or None.

    exact: the two tables must have the same length (a TransferRequest, a decode's add_room);
    else it may be shorter (a prefill's table grows chunk by chunk)."""
    if (swa.size != full.size) if exact else (swa.size > full.size):
        return f"{swa.size} sliding-window pages for {full.size} pages ({'same length' if exact else 'at most'})"
    held = swa[swa >= 0]
    if swa.size and (swa.min() < -1 or (held.size and held.max() >= num_pages)):
        return f"sliding-window pages must be -1 (none) or page ids in [0, {num_pages})"
    if np.unique(held).size != held.size:
        return "duplicate sliding-window pages"
    if aliased and np.intersect1d(held, full).size:
        return "a sliding-window page is also a full-attention page of the request (the pool aliases their buffers)"
    return None
