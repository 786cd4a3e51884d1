"""Checks of a window page table: the sliding-window layers' pages of a request (layout.py).

A window table is aligned with the request's full page table by logical page; entry -1 means no
page there for the sliding layers (slid out of the window and freed, or never needed). A decode's
table (TransferRequest.dst_swa_pages) is aligned with its pages after its cached prefix at its
end, and may start up to the prefix's length in pages before them. Both tables
take ids from one allocator and the pool may alias a sliding layer's buffer with a full layer's,
so on an aliased pool a window page must never also be one of the request's full pages.
"""

from __future__ import annotations

import numpy as np


def window_pages_problem(
    swa: np.ndarray, num_pages: int, full: np.ndarray, *, exact: bool, aliased: bool, max_lead: int = 0
) -> str | None:
    """Why `swa` ([n] int64) is not a valid window table next to the full table `full`, or None.

    exact: the two tables must have the same length (a TransferRequest, a decode's add_room), but
    for up to `max_lead` entries before it (the decode's window pages below its cached prefix,
    max_lead = its prefix in pages); else it may be shorter (a prefill's table grows chunk by chunk)."""
    if (not full.size <= swa.size <= full.size + max_lead) if exact else (swa.size > full.size):
        more = f", or up to {max_lead} more before them" if exact and max_lead else ""
        return f"{swa.size} sliding-window pages for {full.size} pages ({'same length' if exact else 'at most'}{more})"
    held = swa[swa >= 0]
    if swa.size and (swa.min() < -1 or (held.size and held.max() >= num_pages)):
        return f"sliding-window pages must be -1 (none) or page ids in [0, {num_pages})"
    if np.unique(held).size != held.size:
        return "duplicate sliding-window pages"
    if aliased and np.intersect1d(held, full).size:
        return "a sliding-window page is also a full-attention page of the request (the pool aliases their buffers)"
    return None
