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

A PD decode (Scheduler.reserve, `match_full`) computes no prompt token: for an L-token prompt its
first query reads the full layers' [0, L) and the sliding layers' last window of the prompt only,
[window_first_page(L), cdiv(L, ps)). So its hit is the full-layer match D whatever window pages
the cache holds there (a shared system prompt hits although its window slid out of the request
that cached it); of the last window it takes the cache's pages below D where the cache has them
and owns the others (`req.swa_own_shared` below D, the rest from D on), which the prefill fills
(`wanted_window_pages`: it holds them all, they are its prompt's last window too).
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
    m = cache.match_window(req.cache_ids(req.input_ids[:-1]))
    hit = len(m.pages) * page_size
    prompt_end = (len(req.input_ids) - 1) // page_size * page_size
    req.swa_pages = m.swa_pages.copy()
    req.swa_hit_points = tuple(sorted({p for p in (prompt_end, m.kv_tokens) if p > hit}))
    return m.pages, m.node


def match_full(cache: SWARadixCache, req: Req, page_size: int) -> tuple[np.ndarray, RadixNode]:
    """A PD decode's match: the longest cached full-layer prefix D of req's prompt (minus its last
    token), whatever window pages are there; req.swa_pages gets the cache's window pages of the
    prompt's last window below D (-1 where the cache has none: the request allocates those as its
    own and asks the prefill for them). Keeps the window before the prompt's last page boundary
    (a repeat of the prompt reads most of it). Returns the full-layer pages and the node to lock."""
    pages, node = cache.match(req.cache_ids(req.input_ids[:-1]))
    d, n = len(pages), len(req.input_ids)
    first = min(window_first_page(n, cache.window, page_size), d)
    req.swa_pages = np.full(d, -1, dtype=np.int64)
    req.swa_pages[first:d] = cache.path_window_pages(node)[first:d]
    req.swa_own_shared = np.zeros(0, dtype=np.int64)
    prompt_end = (n - 1) // page_size * page_size
    req.swa_hit_points = (prompt_end,) if prompt_end > 0 else ()
    return pages, node


def own_window_mask(req: Req) -> np.ndarray:
    """[len(req.swa_pages)] bool: the window pages that are req's own (it frees them or gives them
    to the cache): those from its cached prefix on and those below it in req.swa_own_shared."""
    swa = req.swa_pages
    mine = swa >= 0
    shared = np.zeros(swa.size, dtype=bool)
    shared[: min(req.num_shared_pages, swa.size)] = True
    own_below = req.swa_own_shared[req.swa_own_shared < swa.size]
    shared[own_below] = False
    return mine & ~shared


def wanted_window_pages(req: Req) -> np.ndarray:
    """A reserved (PD decode) request's window table for its writer: from its first own window
    page below its cached prefix (or from the prefix) on, -1 where the cache holds the page or
    none is wanted (TransferRequest.dst_swa_pages: entries before the prefix come first)."""
    mine = own_window_mask(req)
    shared = req.num_shared_pages
    below = np.flatnonzero(mine[:shared])
    start = int(below[0]) if below.size else shared
    return np.where(mine[start:], req.swa_pages[start:], -1)


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
    own = swa[drop[own_window_mask(req)[drop]]].copy()
    swa[drop] = -1
    return own


def own_window_pages(req: Req) -> np.ndarray:
    """req's window pages that are its own (own_window_mask: those below its cached prefix are the
    cache's, but for a PD decode's own window pages there)."""
    return req.swa_pages[own_window_mask(req)]


def cache_window(cache: SWARadixCache, req: Req, pages: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """At finish: req's full pages of computed KV and its window pages go to the cache (nothing
    after an abort); returns (full pages, window pages) that stay the request's own to free."""
    shared = req.num_shared_pages
    if req.finish_reason is FinishReason.ABORT:
        return pages[shared:], own_window_pages(req)
    full = min(req.num_cached // page_size, len(pages))
    swa, mine = req.swa_pages, own_window_mask(req)
    # only its own window pages fill the cache's tombstones (below its prefix too: a PD decode's)
    give = np.where(mine, swa, -1)[:full]
    dup, taken = cache.insert_window(req.cache_ids(req.all_ids[: full * page_size]), pages[:full], give)
    # pages[:shared] were the cache's all along; [shared, dup) duplicate pages the cache got from
    # another request meanwhile; [dup, full) are the cache's now
    own = np.concatenate([pages[shared:dup], pages[full:]])
    mine[: taken.size] &= ~taken
    return own, swa[mine]
