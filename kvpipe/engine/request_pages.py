"""Each admitted request's KV pages, apart from any tensor: the most it was promised at
admission, the pages it holds (req.pages, and a sliding-window model's req.swa_pages), and where
they go when it ends (the allocator, or the prefix cache).

Pages are allocated lazily, per step, for exactly the tokens that step writes, never past the
request's promise (the scheduler admits a request only when its promise fits, so a running
request never runs out of pages). A sliding-window model's window pages are allocated for the
pages a step's queries can see and freed once the window slid past them (`slide`); a verify
step's pages past the accepted tokens go back at once (`rollback`). At the end a request's full
pages of computed KV go to the prefix cache, the rest to the allocator (`free`).
"""

from __future__ import annotations

import numpy as np

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.store_tier import StoreTier
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_first_page
from kvpipe.engine.hybrid_state import cache_snapshots
from kvpipe.engine.request import Req
from kvpipe.engine.window_cache import cache_window, own_window_mask, own_window_pages, slide_kept


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageLedger:
    def __init__(self, allocator: PageAllocator, page_size: int, cache: RadixCache | None, window: int | None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache
        self.window = window  # sliding-window layers' window (tokens): they get window pages
        self._promised: dict[str, tuple[Req, int]] = {}  # rid -> (request, pages it may hold at most)
        # a KV tier shared with other servers (cache/store_tier.py): full prefixes stored at the end
        self.kv_tier: StoreTier | None = None

    # ---- promises --------------------------------------------------------------------------
    def promise(self, req: Req, pages: int) -> None:
        self._promised[req.rid] = (req, pages)

    def withdraw(self, rid: str) -> None:
        """`rid` ended: it allocates nothing more."""
        self._promised.pop(rid, None)

    def outstanding(self) -> int:
        """Pages promised to admitted requests but not allocated yet."""
        return sum(n - self.own_pages(r) for r, n in self._promised.values())

    @staticmethod
    def own_pages(req: Req) -> int:
        # window pages below a cached prefix are the cache's too, but for a PD decode's own there (window_cache.py)
        return len(req.pages) - req.num_shared_pages + int(own_window_mask(req).sum())

    def available(self) -> int:
        """Pages a new allocation can get: free ones and cached ones nobody reads."""
        return self.allocator.num_free + (self.cache.evictable_pages if self.cache is not None else 0)

    def cached_pages(self) -> int:
        """Pages the prefix cache holds, of both kinds (a sliding-window model's window pages too)."""
        if isinstance(self.cache, SWARadixCache):
            return self.cache.num_pages + self.cache.num_swa_pages
        return self.cache.num_pages if self.cache is not None else 0

    # ---- allocation ------------------------------------------------------------------------
    def ensure(self, req: Req, tokens: int) -> None:
        """Pages for `req`'s first `tokens` tokens."""
        need = _cdiv(tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return
        promised = self._promised[req.rid][1]
        if self.own_pages(req) + need > promised:
            raise RuntimeError(
                f"request {req.rid!r} needs more than its {promised} "
                f"promised pages ({tokens} tokens); it should have finished"
            )
        req.pages = np.concatenate([req.pages, self._alloc(need)])

    def _alloc(self, n: int) -> np.ndarray:
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:  # admission counted on these: take them back
            self.allocator.free(self.cache.evict(short))
        return self.allocator.alloc(n)

    def ensure_window(self, req: Req, first_pos: int, tokens: int) -> None:
        """Sliding-window pages for a step whose first query sits at `first_pos` and after which
        `tokens` tokens have KV: the logical pages from the one its first query's window starts in
        to the last one written."""
        if self.window is None:
            return
        end = _cdiv(tokens, self.page_size)
        if req.swa_pages.size < end:
            req.swa_pages = np.concatenate([req.swa_pages, np.full(end - req.swa_pages.size, -1, dtype=np.int64)])
        first = window_first_page(first_pos, self.window, self.page_size)
        missing = np.flatnonzero(req.swa_pages[first:end] < 0) + first
        if missing.size == 0:
            return
        promised = self._promised[req.rid][1]
        if self.own_pages(req) + missing.size > promised:
            raise RuntimeError(
                f"request {req.rid!r} needs more than its {promised} promised "
                f"pages (sliding window up to {tokens} tokens)"
            )
        req.swa_pages[missing] = self._alloc(int(missing.size))
        below = missing[missing < req.num_shared_pages]  # a PD decode's last window before its prefix's end
        if below.size:
            req.swa_own_shared = np.union1d(req.swa_own_shared, below)

    def slide(self, req: Req) -> None:
        """Free the sliding-window pages no later query of `req` can see."""
        if self.window is None or req.swa_pages.size == 0:
            return
        if isinstance(self.cache, SWARadixCache):
            self.allocator.free(slide_kept(req, self.window, self.page_size))
            return
        first = window_first_page(req.num_cached, self.window, self.page_size)
        gone = req.swa_pages[:first]
        if (gone >= 0).any():
            self.allocator.free(gone[gone >= 0])
            gone[:] = -1

    def rollback(self, req: Req) -> None:
        """Free the pages past the ones holding req's num_cached tokens (what a verify step
        allocated for drafts that were rejected); a cached prefix's pages are never touched."""
        keep = max(_cdiv(req.num_cached, self.page_size), req.num_shared_pages)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            req.pages = req.pages[:keep].copy()
        if req.swa_pages.size > keep:  # sliding layers: the window pages only rejected drafts reached
            past = req.swa_pages[keep:]
            self.allocator.free(past[past >= 0])
            req.swa_pages = req.swa_pages[:keep].copy()

    # ---- the end ---------------------------------------------------------------------------
    def unpin(self, req: Req) -> None:
        """Let go of `req`'s cached prefix (the cache may evict it once nobody reads it)."""
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = None
        req.num_shared_pages = 0

    def free(self, req: Req) -> None:
        """Return a finished request's pages: with a prefix cache its full pages of computed KV
        go to the cache (its own duplicates of what the cache has, and the rest, to the allocator)."""
        pages = req.pages
        own_swa = own_window_pages(req)
        if isinstance(self.cache, HybridRadixCache):
            own = cache_snapshots(self.cache, req, pages)
            self.unpin(req)
        elif isinstance(self.cache, SWARadixCache):
            own, own_swa = cache_window(self.cache, req, pages, self.page_size)
            self.unpin(req)
        elif self.cache is not None:
            full = min(req.num_cached // self.page_size, len(pages))
            dup = self.cache.insert(req.cache_ids(req.all_ids[: full * self.page_size]), pages[:full])
            if self.kv_tier is not None and req.cache_salt is None:  # a salted prompt skips the tier
                self.kv_tier.store_prefix(req.all_ids[: full * self.page_size], pages[:full])
            # pages[:num_shared_pages] were the cache's all along; [shared, dup) duplicate pages the
            # cache got from another request meanwhile; [dup, full) are the cache's now
            own = np.concatenate([pages[req.num_shared_pages : dup], pages[full:]])
            self.unpin(req)
        else:
            own = pages
        self.allocator.free(own)
        self.allocator.free(own_swa)
        req.pages = np.zeros(0, dtype=np.int64)
        req.swa_pages = np.zeros(0, dtype=np.int64)
        req.swa_own_shared = np.zeros(0, dtype=np.int64)
