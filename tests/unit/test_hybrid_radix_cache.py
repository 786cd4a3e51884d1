"""The hybrid radix cache's snapshot bookkeeping: snapshots hang on the nodes where they were taken,
a match ending at a tombstone falls back to the deepest ancestor with a snapshot, pages are cached
only up to the deepest snapshot, eviction frees a leaf's pages and snapshot together, snapshot
eviction takes the least recently used and drops the pages it leaves unreachable, and pinned
snapshots stay."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.recurrent_slots import StateSlotAllocator

PS = 2
RUNNING = 4  # snapshot slots come after the running requests' slots of the pool


def make(snapshots: int = 8) -> HybridRadixCache:
    return HybridRadixCache(PS, StateSlotAllocator(snapshots, first=RUNNING))


def slot(cache: HybridRadixCache, owner: str = "r") -> int:
    s, freed = cache.alloc_snapshot(owner)
    assert s is not None and freed.size == 0
    return s


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def test_insert_hangs_snapshots_and_caches_pages_up_to_the_deepest():
    cache = make()
    ids = list(range(10, 20))  # 5 pages
    a, b = slot(cache), slot(cache)
    assert a >= RUNNING and b >= RUNNING
    dup, n = cache.insert_state(ids, pages(0, 1, 2, 3, 4), {2: a, 6: b})
    assert (dup, n) == (0, 3)  # pages 3 and 4 lie past the last snapshot: still the caller's
    assert cache.num_pages == 3 and cache.num_snapshots == 2 and sorted(cache.all_snapshots()) == [a, b]
    m = cache.match_state(ids)
    assert m.snapshot == b and m.pages.tolist() == [0, 1, 2] and m.kv_tokens == 6
    m = cache.match_state(ids[:5])  # ends mid-way to b: back to a
    assert m.snapshot == a and m.pages.tolist() == [0] and m.kv_tokens == 4


def test_a_match_ending_at_a_tombstone_falls_back_to_an_ancestor():
    cache = make()
    sys_prompt = [7, 7, 8, 8]  # 2 pages shared, then two different tails
    a, b = slot(cache), slot(cache)
    cache.insert_state(sys_prompt + [1, 1], pages(0, 1, 2), {6: a})
    dup, n = cache.insert_state(sys_prompt + [2, 2], pages(5, 6, 7), {6: b})
    assert (dup, n) == (2, 3)  # the caller frees its pages 5 and 6: the cache had them
    m = cache.match_state(sys_prompt + [3, 3])
    assert m.node is cache.root and m.snapshot is None and m.pages.size == 0  # tombstone at 4
    assert m.kv_tokens == 4  # but the KV was there: a snapshot at 4 would make this a hit
    c = slot(cache)
    cache.insert_state(sys_prompt + [3, 3], pages(8, 9, 10), {4: c})  # the branch point
    m = cache.match_state(sys_prompt + [4, 4])
    assert m.snapshot == c and m.pages.tolist() == [0, 1]


def test_a_duplicate_snapshot_is_freed():
    cache = make(snapshots=3)
    ids = [1, 2, 3, 4]
    a, b = slot(cache), slot(cache)
    cache.insert_state(ids, pages(0, 1), {4: a})
    assert cache.insert_state(ids, pages(2, 3), {4: b}) == (2, 2)
    assert cache.all_snapshots() == [a] and cache.snapshots.owner(b) is None and cache.snapshots.num_free == 2


def test_an_insert_without_snapshots_caches_nothing():
    cache = make()
    assert cache.insert_state([1, 2, 3, 4], pages(0, 1), {}) == (0, 0)
    assert cache.num_pages == 0 and cache.match_state([1, 2, 3, 4]).kv_tokens == 0


def test_page_eviction_frees_tombstone_leaves_first_and_snapshots_with_their_pages():
    cache = make()
    a, b = slot(cache), slot(cache)
    cache.insert_state([1, 1, 2, 2], pages(0, 1), {4: a})
    cache.insert_state([1, 1, 3, 3, 4, 4], pages(9, 2, 3), {2: b})  # leaves 1 page cached: [1, 1]
    # tree: [1,1](b) -> [2,2](a); nothing past b cached from the second insert
    assert cache.num_pages == 2
    freed = cache.evict(1)
    assert freed.tolist() == [1] and cache.all_snapshots() == [b]  # leaf [2,2] went with a
    assert cache.snapshots.owner(a) is None
    freed = cache.evict(1)
    assert freed.tolist() == [0] and cache.num_snapshots == 0 and cache.snapshots.num_free == 8
    # a leaf without a snapshot (a tombstone) goes before an older leaf with one
    c, d = slot(cache), slot(cache)
    cache.insert_state([5, 5, 6, 6], pages(10, 11), {4: c})  # older
    cache.insert_state([7, 7, 8, 8], pages(12, 13), {2: d, 4: slot(cache)})
    t = cache.match_state([7, 7, 8, 8]).node
    cache._drop_snapshot(t)  # leaf [8, 8] becomes a tombstone
    assert cache.evict(1).tolist() == [13] and sorted(cache.all_snapshots()) == sorted([c, d])


def test_snapshot_eviction_takes_the_least_recent_and_drops_unreachable_pages():
    cache = make(snapshots=3)
    a, b, c = slot(cache), slot(cache), slot(cache)
    cache.insert_state([1, 1, 2, 2], pages(0, 1), {2: a, 4: b})
    cache.insert_state([1, 1, 3, 3], pages(7, 2), {4: c})  # [1,1](a) -> [2,2](b) | [3,3](c)
    cache.match_state([1, 1, 3, 3])  # b is now the least recently used
    s, freed = cache.alloc_snapshot("new")
    assert s == b and freed.tolist() == [1]  # its leaf could never be hit again: its page goes
    assert cache.num_pages == 2 and cache.match_state([1, 1, 2, 2]).snapshot == a  # falls back to a
    cache.snapshots.free(s)
    cache.alloc_snapshot("x")  # a free slot: nothing evicted
    s, freed = cache.alloc_snapshot("new2")  # a and c touched together: the leaf c goes first
    assert s == c and freed.tolist() == [2] and cache.all_snapshots() == [a] and cache.num_pages == 1
    cache.snapshots.free(s)
    cache.alloc_snapshot("y")
    s, freed = cache.alloc_snapshot("new3")
    assert s == a and freed.tolist() == [0] and cache.num_pages == 0 and cache.num_snapshots == 0


def test_pinned_snapshots_are_neither_evicted_nor_reused():
    cache = make(snapshots=1)
    a = slot(cache)
    cache.insert_state([1, 1, 2, 2], pages(0, 1), {4: a})
    m = cache.match_state([1, 1, 2, 2, 3])
    cache.lock(m.node)
    s, freed = cache.alloc_snapshot("other")
    assert s is None and freed.size == 0  # all pinned: no slot
    assert cache.evict(2).size == 0 and cache.all_snapshots() == [a]
    cache.unlock(m.node)
    s, freed = cache.alloc_snapshot("other")
    assert s == a and sorted(freed.tolist()) == [0, 1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 2), min_size=1, max_size=10), st.integers(0, 5), st.sampled_from(["lock", "none"])
        ),
        min_size=1,
        max_size=25,
    )
)
def test_pages_and_snapshots_stay_accounted_for(ops):
    """Random inserts (like a finishing request: its own pages, snapshots at page ends), matches
    (pinned while "running"), snapshot and page eviction against a real allocator: every page and slot has one
    owner, the tree never holds a snapshot without its pages, nothing leaks."""
    cache, alloc = make(snapshots=3), PageAllocator(200)
    locked = []
    for ids, n_snaps, lock in ops:
        m = cache.match_state(ids[:-1] if len(ids) > 1 else [])
        cache.lock(m.node)  # a request pins its match while it runs
        full = len(ids) // PS
        mine = np.concatenate([m.pages, alloc.alloc(full - len(m.pages))])
        snaps = {}
        for pos in sorted({PS * k for k in range(1, full + 1)} - {len(m.pages) * PS})[-n_snaps:] if n_snaps else []:
            s, freed = cache.alloc_snapshot("req")
            alloc.free(freed)
            if s is not None:
                snaps[pos] = s
        dup, n = cache.insert_state(ids, mine, snaps)
        shared = len(m.pages)
        alloc.free(np.concatenate([mine[shared : max(dup, shared)], mine[max(n, shared) :]]))
        if lock == "lock":  # some requests stay running a while longer
            locked.append(m.node)
        else:
            cache.unlock(m.node)
        if len(locked) > 3:
            cache.unlock(locked.pop(0))
        alloc.free(cache.evict(1))
        held = cache.all_pages()
        assert np.unique(held).size == held.size == cache.num_pages == alloc.num_used
        snaps_held = cache.all_snapshots()
        assert len(snaps_held) == cache.num_snapshots == cache.snapshots.num_used
    for node in locked:
        cache.unlock(node)
    while cache.num_pages:
        alloc.free(cache.evict(cache.num_pages))
    assert alloc.num_used == 0 and cache.num_snapshots == 0 and cache.snapshots.num_free == 3
