"""Page arithmetic of sliding-window layers (GPT-OSS): which logical pages a window still reaches.

A sliding layer with window W lets the query at position i see keys j with i - W < j <= i. A
request's sliding-layer pages therefore only matter from the page holding key i - W + 1 of its
next query on; the pages before slide out and are freed (engine/scheduler.py), while its full-attention
layers keep every page. Pure integer arithmetic, no tensors.
"""

from __future__ import annotations


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_first_page(next_pos: int, window: int, page_size: int) -> int:
    """First logical page the query at position `next_pos` still sees (its oldest key is
    next_pos - window + 1)."""
    return max(0, next_pos - window + 1) // page_size


def prompt_window_pages(prompt_len: int, window: int, page_size: int) -> tuple[int, int]:
    """Logical pages [first, end) of a prompt's sliding-layer pages that a PD decode reserves
    (engine/scheduler.py: the first decode query, at position prompt_len, sees only these) and so the
    prefill sends; its full layers take all of [0, end)."""
    return window_first_page(prompt_len, window, page_size), _cdiv(prompt_len, page_size)


def window_page_bound(window: int, max_extend: int, page_size: int) -> int:
    """Most sliding-layer pages one request holds at once when a step adds at most `max_extend`
    tokens: keys [p - window + 1, p + n) span at most window - 1 + n tokens, which touch at most
    cdiv(window - 1 + n, page_size) + 1 pages (one more when they start mid-page)."""
    return _cdiv(window - 1 + max(max_extend, 1), page_size) + 1
