"""The radix cache of a sliding-window model (GPT-OSS): full-layer pages for every cached token,
sliding-layer (window) pages only where a hit may start, no tensors.

A request that starts at a cached prefix of P tokens (page aligned) computes from position P on;
its first query sees keys (P - window, P], so besides the full layers' pages of [0, P) it needs
the sliding layers' pages of logical pages [window_first_page(P), P / page_size) and no others
(cache/window_pages.py). A running request frees the window pages its window slid past, so a
node holds a sliding page per full page (`RadixNode.swa_pages`, aligned with `pages`) where the
cache got one and -1 where not, or where eviction took it back: a tombstone (SGLang's SWA radix
cache). A match therefore stops at the deepest page boundary on the full-layer match whose window
pages are all present (`match_window`), splitting the edge there.

    m = cache.match_window(ids)              # full pages, window pages of the usable prefix
    pages, node = cache.match(ids)           # a PD decode's hit: the full-layer match (it computes
    swa = cache.path_window_pages(node)      # nothing) and whatever window pages are on its path
    cache.lock(m.node) ... cache.unlock(m.node)
    dup, taken = cache.insert_window(ids, pages, swa_pages, shared)
    freed = cache.evict(n)                   # tombstone window pages / remove leaves, LRU

Ownership: inserted pages of both kinds are the cache's; `insert_window` reports which window
pages of the request it took (it fills tombstones, and new nodes, from them). Pinning: a lock pins
every page of the path to the root, window pages included (a running request may read the window
before its hit point, which may reach several nodes up). Eviction frees pages one node at a time,
least recently used first: a leaf goes whole (tombstoned leaves first: no hit can end in them
unless a window reaches back into their parent), an inner node only loses its window pages (its
full pages still serve its descendants).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpipe.cache.radix_cache import RadixCache, RadixNode
from kvpipe.cache.window_pages import window_first_page


@dataclass(frozen=True)
class WindowMatch:
    pages: np.ndarray  # [d] full-layer pages of the usable prefix
    swa_pages: np.ndarray  # [d] its window pages: [window_first_page(d * ps), d) the cache's, -1 before
    node: RadixNode  # where the usable prefix ends (lock it); the root: nothing usable
    kv_tokens: int  # tokens the full-layer pages alone matched (>= the usable prefix)


class SWARadixCache(RadixCache):
    def __init__(self, page_size: int, window: int) -> None:
        super().__init__(page_size)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.num_swa_pages = 0  # window pages the cache holds
        self.locked_swa_pages = 0  # of which some request pins

    # ---- window pages of a node --------------------------------------------------------------
    @staticmethod
    def _swa(node: RadixNode) -> np.ndarray:
        """node's window pages (-1: none), created all -1 for a node that never got one."""
        if node.swa_pages is None:
            node.swa_pages = np.full(node.num_pages, -1, dtype=np.int64)
        return node.swa_pages

    @staticmethod
    def _held(node: RadixNode) -> int:
        return 0 if node.swa_pages is None else int((node.swa_pages >= 0).sum())

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        swa = self._swa(child)
        upper = super()._split(child, n)
        upper.swa_pages, child.swa_pages = swa[:n].copy(), swa[n:].copy()
        return upper

    # ---- lookups -------------------------------------------------------------------------------
    def hit_ok(self, swa: np.ndarray, d: int) -> bool:
        """Whether a hit of d pages may start there: the window pages its first query reads, of
        logical pages [window_first_page(d * ps), d), are all in `swa` (the path's, by page)."""
        return bool((swa[window_first_page(d * self.page_size, self.window, self.page_size) : d] >= 0).all())

    def match_window(self, token_ids: Sequence[int]) -> WindowMatch:
        """The longest cached page-aligned prefix of `token_ids` whose window pages are present (a
        full-layer match ending in a tombstone falls back to the deepest boundary that has them)."""
        ps = self.page_size
        pages, node = self.match(token_ids)
        kv_tokens = len(pages) * ps
        swa = self.path_window_pages(node)
        d = len(pages)
        while d > 0 and not self.hit_ok(swa, d):
            d -= 1
        if d < len(pages):
            pages, node = self.match(token_ids[: d * ps])  # splits so that a node ends at d
        out = np.full(d, -1, dtype=np.int64)
        first = window_first_page(d * ps, self.window, ps)
        out[first:d] = swa[first:d]
        return WindowMatch(pages, out, node, kv_tokens)

    def path_window_pages(self, node: RadixNode) -> np.ndarray:
        """[pages on the path] the window pages of the path from the root to `node`, by logical
        page (-1: a tombstone, or never had one)."""
        path = list(self._path(node))[::-1]  # root side first
        return np.concatenate([self._swa(n) for n in path]) if path else np.zeros(0, dtype=np.int64)

    # ---- insert --------------------------------------------------------------------------------
    def insert_window(
        self, token_ids: Sequence[int], pages: np.ndarray, swa_pages: np.ndarray, shared: int = 0
    ) -> tuple[int, np.ndarray]:
        """Cache a sequence's full pages (as RadixCache.insert: returns `dup`) and the window pages
        the cache lacks of `swa_pages` (aligned with pages, -1: none; logical pages below `shared`
        are the cache's already and are skipped). Returns (dup, taken): taken[i] says the cache
        took swa_pages[i]; the caller frees the others it owns."""
        ps = self.page_size
        n = min(len(token_ids) // ps, len(pages))
        dup = self.insert(token_ids[: n * ps], pages[:n])
        mine = np.full(n, -1, dtype=np.int64)
        k = min(n, len(swa_pages))
        mine[:k] = swa_pages[:k]
        mine[: min(shared, n)] = -1
        taken = np.zeros(len(swa_pages), dtype=bool)
        _, node = self.match(token_ids[: n * ps])
        end = n
        for nd in self._path(node):  # leaf side first
            start = end - nd.num_pages
            have, give = self._swa(nd), mine[start:end]
            fill = (have < 0) & (give >= 0)
            have[fill] = give[fill]
            hi = min(end, k)  # mine is -1 from k on: nothing taken there
            if hi > start:
                taken[start:hi] = fill[: hi - start]
            count = int(fill.sum())
            self.num_swa_pages += count
            if nd.refs > 0:
                self.locked_swa_pages += count
            end = start
        return dup, taken

    # ---- locks ---------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        for n in self._path(node):
            if n.refs == 0:
                self.locked_swa_pages += self._held(n)
        super().lock(node)

    def unlock(self, node: RadixNode) -> None:
        super().unlock(node)
        for n in self._path(node):
            if n.refs == 0:
                self.locked_swa_pages -= self._held(n)

    # ---- eviction ------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self.locked_pages + self.num_swa_pages - self.locked_swa_pages

    def evict(self, num_pages: int) -> np.ndarray:
        """Free up to `num_pages` unpinned pages of either kind (possibly a few more: a node at a
        time), least recently used node first: a leaf whole, an inner node's window pages."""
        out: list[np.ndarray] = []
        freed = 0
        while freed < num_pages:
            nodes = [n for n in self._nodes() if n.refs == 0 and (not n.children or self._held(n))]
            if not nodes:
                break
            # a parent becomes a leaf only after its children go: recompute after each round
            for nd in sorted(nodes, key=self._swa_evict_order):
                if freed >= num_pages:
                    break
                swa = self._swa(nd)
                gone = swa[swa >= 0]
                out.append(gone)
                self.num_swa_pages -= gone.size
                freed += gone.size
                swa[:] = -1
                if not nd.children:
                    out.append(nd.pages)
                    self.num_pages -= nd.num_pages
                    freed += nd.num_pages
                    self._remove(nd)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _swa_evict_order(self, node: RadixNode) -> tuple[bool, int, bool]:
        # tombstoned leaves first; then least recently used, on a tie (a path touched at once)
        # the leaf before the inner nodes above it
        return (bool(node.children) or self._held(node) > 0, node.last_access, bool(node.children))

    def all_pages(self) -> np.ndarray:
        """Every page id the cache holds, of both kinds (for invariant checks)."""
        parts = [n.pages for n in self._nodes()] + [
            n.swa_pages[n.swa_pages >= 0] for n in self._nodes() if n.swa_pages is not None
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
