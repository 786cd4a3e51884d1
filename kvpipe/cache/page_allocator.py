"""Page allocator: pure bookkeeping over page ids, no tensors.

Pages are handed out lowest-id first so a fresh request gets a contiguous run, which the
transfer planner coalesces into few ops.
"""

from __future__ import annotations

import heapq

import numpy as np


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    def __init__(self, num_pages: int, debug_checks: bool = True) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.debug_checks = debug_checks
        self._free: list[int] = list(range(num_pages))  # a min-heap
        # in_use[p] is True while page p belongs to someone; catches double free / use after free.
        self._in_use = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        """Return `n` page ids (int64, ascending) or raise OutOfPagesError without side effects."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = np.fromiter((heapq.heappop(self._free) for _ in range(n)), dtype=np.int64, count=n)
        self._in_use[pages] = True
        return pages

    def free(self, pages: np.ndarray | list[int]) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        if self.debug_checks:
            if pages.min() < 0 or pages.max() >= self.num_pages:
                raise ValueError(f"page id out of range [0, {self.num_pages}): {pages}")
            if np.unique(pages).size != pages.size:
                raise RuntimeError(f"double free: duplicate page ids in {pages}")
            if not self._in_use[pages].all():
                raise RuntimeError(f"double free of pages {pages[~self._in_use[pages]].tolist()}")
        self._in_use[pages] = False
        for p in pages.tolist():
            heapq.heappush(self._free, p)

    def check_owned(self, pages: np.ndarray) -> None:
        """Debug check before touching pages: every id must be currently allocated."""
        if self.debug_checks and pages.size and not self._in_use[pages].all():
            raise RuntimeError(f"use after free of pages {pages[~self._in_use[pages]].tolist()}")
