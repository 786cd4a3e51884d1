"""The page-granular radix cache: match / insert / split / evict, locks, and (property-based)
that a matched page always holds the KV of exactly that prefix, that locked pages are never
evicted, and that every page id is owned by exactly one party at any time."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.cache.radix_cache import RadixCache

PS = 2


def test_match_insert_split_evict() -> None:
    c = RadixCache(PS)
    pages, node = c.match([1, 2, 3, 4])
    assert pages.size == 0 and node is c.root
    assert c.insert([1, 2, 3, 4, 5], np.array([10, 11, 12])) == 0  # 2 whole pages; token 5 is partial
    assert c.num_pages == 2  # page 12 (partial) is not the cache's: the caller still owns it
    pages, node = c.match([1, 2, 3, 4, 9])
    assert pages.tolist() == [10, 11]
    pages, node = c.match([1, 2, 7, 7])  # shares the first page only: the edge splits
    assert pages.tolist() == [10] and node.tokens == (1, 2) and len(c.root.children) == 1
    assert c.insert([1, 2, 7, 7], np.array([20, 21])) == 1  # the caller frees its page 20
    assert sorted(c.all_pages().tolist()) == [10, 11, 21] and c.num_pages == 3
    c.lock(node)  # pins page 10 only
    assert c.locked_pages == 1 and c.evictable_pages == 2
    freed = c.evict(10)
    assert sorted(freed.tolist()) == [11, 21] and c.num_pages == 1  # 10 is pinned
    c.unlock(node)
    with pytest.raises(ValueError):  # one unlock per lock
        c.unlock(node)
    assert c.evict(1).tolist() == [10] and c.num_pages == 0


def test_lru_order_and_locks_through_splits() -> None:
    c = RadixCache(PS)
    c.insert([1, 1, 2, 2], np.array([0, 1]))
    c.insert([3, 3], np.array([2]))
    c.match([1, 1, 2, 2])  # touched last: [3, 3] is older
    assert c.evict(1).tolist() == [2]
    _, whole = c.match([1, 1, 2, 2])
    c.lock(whole)
    _, part = c.match([1, 1, 5, 5])  # splits the locked edge: both halves stay pinned
    assert c.locked_pages == 2 and c.evict(5).size == 0
    c.unlock(whole)
    assert c.evict(1).tolist() == [1] and c.evict(1).tolist() == [0]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match_lock", "unlock", "evict"]),
        st.lists(st.integers(0, 2), min_size=0, max_size=9),
        st.integers(0, 4),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_properties(ops) -> None:
    c = RadixCache(PS)
    ids = itertools.count()
    prefix_of: dict[int, tuple[int, ...]] = {}  # page id -> the tokens of its whole prefix
    owned_by_caller: set[int] = set()
    locks: list = []
    locked_pages: list[set[int]] = []
    for op, seq, n in ops:
        if op == "insert":
            pages = np.array([next(ids) for _ in range(len(seq) // PS)], dtype=np.int64)
            for i, p in enumerate(pages):
                prefix_of[int(p)] = tuple(seq[: (i + 1) * PS])
            dup = c.insert(seq, pages)
            owned_by_caller.update(int(p) for p in pages[:dup])  # freed by the caller
        elif op == "match_lock":
            pages, node = c.match(seq)
            for i, p in enumerate(pages.tolist()):  # a matched page holds exactly that prefix
                assert prefix_of[p] == tuple(seq[: (i + 1) * PS])
            c.lock(node)
            locks.append(node)
            locked_pages.append(set(pages.tolist()))
        elif op == "unlock" and locks:
            i = n % len(locks)  # any lock, not only the newest
            c.unlock(locks.pop(i))
            locked_pages.pop(i)
        elif op == "evict":
            freed = set(c.evict(n).tolist())
            assert not freed & set().union(*locked_pages), "a locked page was evicted"
            owned_by_caller |= freed
        held = c.all_pages().tolist()
        assert len(held) == len(set(held)) == c.num_pages  # each page once
        assert not set(held) & owned_by_caller  # never both the cache's and the caller's
        assert 0 <= c.locked_pages <= c.num_pages
    for node in reversed(locks):
        c.unlock(node)
    assert c.locked_pages == 0
    owned_by_caller |= set(c.evict(10**9).tolist())
    assert c.num_pages == 0 and c.all_pages().size == 0
    assert owned_by_caller == set(prefix_of)  # every page came back exactly once
