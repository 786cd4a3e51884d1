"""The scheduler's share of a sliding-window model's prefix cache (SWARadixCache): a match that
restores the request's window page table, which window pages a running request keeps from
sliding out so that the cache gets them, and what goes to the cache at finish. Bookkeeping only.

A hit at P tokens gives req.pages[:P / ps] (full layers) and req.swa_pages[window_first_page(P) :
P / ps] (sliding layers), both the cache's (pinned by the lock); the request computes from P on.
Window pages are useful to the cache only before a point where a later prompt may start, so while
it runs a request keeps, besides its window, the window before:
- its last full page boundary, floor(num_cached / ps) * ps: a multi-turn conversation's next turn
  starts there, and at finish that is the window a request holds anyway (one page more at most);
- `swa_hit_points`: the prompt's last page boundary floor((len - 1) / ps) * ps (a repeat of the
  prompt starts there), and where its full-layer match outran the window pages (a shared system
  prompt whose window slid out of the request that cached it: the next such prompt hits).
The rest slides out as without a cache. At finish (not after an abort: that inserts nothing) the
cache takes the full pages and fills its window tombstones from the request's window pages.
"""

from __future__ import annotations

import numpy as np

from kvpipe.cache.radix_cache import RadixNode
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_first_page, window_page_bound
from kvpipe.engine.request import FinishReason, Req

HIT_POINTS = 2  # most swa_hit_points a request keeps a window for (prompt end, match branch)


def match_window(cache: SWARadixCache, req: Req, page_size: int) -> tuple[np.ndarray, RadixNode]:
    """The longest cached prefix of req's prompt (minus its last token) with its window pages:
    sets req.swa_pages (the cache's window pages before the hit) and req.swa_hit_points; returns
    the full-layer pages and the node to lock."""
    m = cache.match_window(req.input_ids[:-1])
    hit = len(m.pages) * page_size
    prompt_end = (len(req.input_ids) - 1) // page_size * page_size
    req.swa_pages = m.swa_pages.copy()
    req.swa_hit_points = tuple(sorted({p for p in (prompt_end, m.kv_tokens) if p > hit}))
    return m.pages, m.node


def window_promise(window: int, max_extend: int, page_size: int) -> int:
    """Most window pages a request holds at once with the cache: its window from its last full
    page boundary (up to page_size - 1 keys more than without) plus the windows before its hit
    points."""
    return window_page_bound(window + page_size - 1, max_extend, page_size) + HIT_POINTS * window_page_bound(
        window, 1, page_size
    )


def slide_kept(req: Req, window: int, page_size: int) -> np.ndarray:
    """Drop from req's window table the pages no later query reads and no hit point keeps; returns
    those of them that are req's own (the caller frees them; the cache's stay the cache's)."""
    swa, ps = req.swa_pages, page_size
    first = min(window_first_page(req.num_cached // ps * ps, window, ps), swa.size)
    if first == 0:
        return np.zeros(0, dtype=np.int64)
    keep = np.zeros(first, dtype=bool)
    for pos in req.swa_hit_points:
        keep[window_first_page(pos, window, ps) : pos // ps] = True
    drop = np.flatnonzero(~keep & (swa[:first] >= 0))
    own = swa[drop[drop >= req.num_shared_pages]].copy()
    swa[drop] = -1
    return own


def own_window_pages(req: Req) -> np.ndarray:
    """req's window pages that are its own (those below its cached prefix are the cache's)."""
    mine = req.swa_pages[req.num_shared_pages :]
    return mine[mine >= 0]


def cache_window(cache: SWARadixCache, req: Req, pages: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """At finish: req's full pages of computed KV and its window pages go to the cache (nothing
    after an abort); returns (full pages, window pages) that stay the request's own to free."""
    shared = req.num_shared_pages
    if req.finish_reason is FinishReason.ABORT:
        return pages[shared:], own_window_pages(req)
    full = min(req.num_cached // page_size, len(pages))
    swa = req.swa_pages
    dup, taken = cache.insert_window(req.all_ids[: full * page_size], pages[:full], swa[:full], shared)
    # pages[:shared] were the cache's all along; [shared, dup) duplicate pages the cache got from
    # another request meanwhile; [dup, full) are the cache's now
    own = np.concatenate([pages[shared:dup], pages[full:]])
    mine = swa >= 0
    mine[: min(shared, swa.size)] = False
    mine[: taken.size] &= ~taken
    return own, swa[mine]
