"""The sliding-window radix cache's bookkeeping: full pages for every token, window pages only where
given; a match stops at the deepest page boundary whose window pages are all there (a tombstone
falls back), splits keep the two tables aligned, an insert fills tombstones, eviction tombstones
inner nodes' window pages and removes leaves (least recently used first), locks pin both kinds,
and every page is counted once through random operations."""

from __future__ import annotations

import random

import numpy as np

from kvpipe.cache.radix_cache import RadixNode
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.cache.window_pages import window_first_page

PS, W = 2, 4  # a hit at P tokens needs the window pages of [window_first_page(P), P / PS)


def arr(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def window_of(pages: int) -> tuple[int, int]:
    return window_first_page(pages * PS, W, PS), pages


def test_a_hit_needs_the_window_before_it():
    c = SWARadixCache(PS, W)
    ids = list(range(10, 22))  # 6 pages; the window before 12 tokens is pages [4, 6)
    assert window_of(6) == (4, 6)
    dup, taken = c.insert_window(ids, arr(0, 1, 2, 3, 4, 5), arr(-1, -1, -1, -1, 14, 15))
    assert dup == 0 and taken.tolist() == [False] * 4 + [True] * 2
    assert (c.num_pages, c.num_swa_pages) == (6, 2)
    m = c.match_window(ids)
    assert m.pages.tolist() == [0, 1, 2, 3, 4, 5] and m.swa_pages.tolist() == [-1, -1, -1, -1, 14, 15]
    assert m.kv_tokens == 12
    m = c.match_window(ids[:9])  # full pages for 8 tokens, but the window before 8 slid out
    assert m.pages.size == 0 and m.node is c.root and m.kv_tokens == 8
    m = c.match_window(ids[:11] + [99])  # 5 full pages match; the window before 10 is [3, 5): 3 is gone
    assert m.pages.size == 0 and m.kv_tokens == 10


def test_the_match_stops_at_the_deepest_boundary_with_its_window_and_splits_there():
    c = SWARadixCache(PS, W)
    ids = list(range(30, 42))  # 6 pages, windows held before 8 (pages 2, 3) and before 12 (4, 5)
    c.insert_window(ids, arr(0, 1, 2, 3, 4, 5), arr(-1, -1, 12, 13, 14, 15))
    m = c.match_window(ids[:10] + [7, 7])  # 5 full pages match; the window before 10 is [3, 5): held
    assert m.pages.tolist() == [0, 1, 2, 3, 4] and m.swa_pages.tolist() == [-1, -1, -1, 13, 14]
    m = c.match_window(ids[:9] + [7])  # full match of 4 pages: the window before 8 is [2, 4)
    assert m.pages.tolist() == [0, 1, 2, 3] and m.swa_pages.tolist() == [-1, -1, 12, 13]
    assert sum(n.num_pages for n in c._path(m.node)) == 4
    # the edge was split at 4 and 5 pages: both halves keep their window pages, aligned
    nodes = list(c._nodes())
    assert sorted(n.num_pages for n in nodes) == [1, 1, 4]
    for n in nodes:
        assert n.swa_pages is not None and n.swa_pages.size == n.num_pages
    assert sorted(c.all_pages().tolist()) == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15]


def test_an_insert_fills_tombstones_and_skips_shared_or_held_pages():
    c = SWARadixCache(PS, W)
    system = list(range(50, 58))  # 4 pages
    c.insert_window(system + [1, 1], arr(0, 1, 2, 3, 4), arr(-1, -1, -1, 13, 14))
    assert c.match_window(system + [2, 2, 2]).pages.size == 0  # the window before 8 lacks page 2
    # a second request computed the system prompt again (own pages 5..9) and kept its window
    dup, taken = c.insert_window(system + [2, 2], arr(5, 6, 7, 8, 9), arr(-1, -1, 22, 23, 24))
    assert dup == 4  # the cache had the system prompt's full pages: the caller frees 5..8
    # page 2's window was a tombstone: taken; page 3's the cache holds (13): not taken; 4 is new
    assert taken.tolist() == [False, False, True, False, True]
    m = c.match_window(system + [3, 3, 3])
    assert m.pages.tolist() == [0, 1, 2, 3] and m.swa_pages.tolist() == [-1, -1, 22, 13]
    # logical pages below `shared` are the cache's already: never taken
    _, taken = c.insert_window(system + [2, 2], arr(0, 1, 2, 3, 9), arr(30, 31, -1, -1, -1), shared=2)
    assert not taken.any() and c.num_swa_pages == 4


def test_locks_pin_both_kinds_and_eviction_goes_lru_node_by_node():
    c = SWARadixCache(PS, W)
    a, b = [1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5, 6, 6]
    c.insert_window(a, arr(0, 1, 2, 3), arr(-1, 11, 12, 13))  # windows before 4 (1) and 8 (2, 3)
    c.insert_window(b, arr(0, 1, 4, 5), arr(-1, -1, 14, 15))  # branches off a after 2 pages
    assert c.num_pages == 6 and c.num_swa_pages == 5 and c.evictable_pages == 11
    m = c.match_window(b[:7])  # 3 full pages (0, 1, 4); the window before 6 tokens is [1, 3)
    assert m.pages.tolist() == [0, 1, 4] and m.swa_pages.tolist() == [-1, 11, 14]
    c.lock(m.node)
    # pinned: the path root..b's 3 pages (0, 1, 4) and its window pages (11, 14)
    assert c.locked_pages == 3 and c.locked_swa_pages == 2 and c.evictable_pages == 6
    freed = c.evict(100)  # everything not pinned
    assert sorted(freed.tolist()) == [2, 3, 5, 12, 13, 15]
    assert c.evictable_pages == 0 and sorted(c.all_pages().tolist()) == [0, 1, 4, 11, 14]
    c.unlock(m.node)
    assert c.locked_pages == c.locked_swa_pages == 0 and c.evictable_pages == 5
    # least recently used first: an inner node loses its window pages, a leaf goes whole
    c.match_window(b[:7])  # touches both nodes at once: the leaf goes before the node above
    assert sorted(c.evict(1).tolist()) == [4, 14]
    assert sorted(c.evict(100).tolist()) == [0, 1, 11]
    assert c.num_pages == c.num_swa_pages == 0


def test_tombstoned_leaves_go_first_then_lru():
    c = SWARadixCache(PS, W)
    c.insert_window([1, 1, 2, 2], arr(0, 1), arr(10, 11))  # old, with its window
    c.insert_window([3, 3, 4, 4], arr(2, 3), arr(-1, -1))  # newer, but a tombstone
    c.insert_window([5, 5, 6, 6], arr(4, 5), arr(14, 15))  # newest
    assert sorted(c.evict(1).tolist()) == [2, 3]  # the tombstone leaf, although it is newer
    assert sorted(c.evict(1).tolist()) == [0, 1, 10, 11]  # then the least recently used
    assert c.match_window([5, 5, 6, 6, 7]).pages.tolist() == [4, 5]


def test_an_inner_node_loses_only_its_window_pages():
    c = SWARadixCache(PS, W)
    c.insert_window([1, 1, 2, 2], arr(0, 1), arr(10, 11))
    c.insert_window([1, 1, 2, 2, 3, 3, 4, 4], arr(0, 1, 2, 3), arr(-1, -1, 12, 13))
    c.match_window([1, 1, 2, 2, 3, 3, 4, 4, 5])  # the leaf is the most recently used
    inner = c.root.children[(1, 1)]
    inner.last_access = 0  # and the inner node the least
    assert sorted(c.evict(1).tolist()) == [10, 11]  # its full pages still serve the leaf
    assert c.match_window([1, 1, 2, 2, 9]).pages.size == 0  # a tombstone now
    assert c.match_window([1, 1, 2, 2, 3, 3, 4, 4, 5]).pages.tolist() == [0, 1, 2, 3]


def check_counts(c: SWARadixCache) -> None:
    nodes: list[RadixNode] = list(c._nodes())
    full = sum(n.num_pages for n in nodes)
    swa = sum(int((n.swa_pages >= 0).sum()) for n in nodes if n.swa_pages is not None)
    assert (c.num_pages, c.num_swa_pages) == (full, swa)
    locked = [n for n in nodes if n.refs > 0]
    assert c.locked_pages == sum(n.num_pages for n in locked)
    assert c.locked_swa_pages == sum(int((n.swa_pages >= 0).sum()) for n in locked if n.swa_pages is not None)
    allp = c.all_pages()
    assert np.unique(allp).size == allp.size == full + swa


def test_random_operations_keep_every_page_counted_once():
    rnd = random.Random(5)
    c = SWARadixCache(PS, W)
    free = list(range(60))  # few: eviction has to make room
    locks: list[RadixNode] = []
    for _ in range(300):
        op = rnd.random()
        if op < 0.5:
            ids = [rnd.randrange(3) for _ in range(rnd.randrange(2, 14))]
            n = len(ids) // PS
            if len(free) < 2 * n:
                free += c.evict(2 * n).tolist()
                if len(free) < 2 * n:
                    continue
            pages = arr(*[free.pop() for _ in range(n)])
            swa = arr(*[free.pop() if rnd.random() < 0.5 else -1 for _ in range(n)])
            dup, taken = c.insert_window(ids, pages, swa)
            free += pages[:dup].tolist() + swa[(swa >= 0) & ~taken].tolist()
        elif op < 0.7:
            m = c.match_window([rnd.randrange(3) for _ in range(rnd.randrange(1, 14))])
            d = m.pages.size
            lo, _ = window_of(d)
            assert (m.swa_pages[lo:d] >= 0).all() and (m.swa_pages[:lo] < 0).all()
            c.lock(m.node)
            locks.append(m.node)
        elif op < 0.85 and locks:
            c.unlock(locks.pop(rnd.randrange(len(locks))))
        else:
            before = c.evictable_pages
            got = c.evict(rnd.randrange(1, 6))
            assert got.size <= before
            free += got.tolist()
        check_counts(c)
    for node in locks:
        c.unlock(node)
    free += c.evict(10_000).tolist()
    assert c.num_pages == c.num_swa_pages == 0 and sorted(free) == list(range(60))
