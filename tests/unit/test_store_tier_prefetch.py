"""The KV tier's prefetch (cache/store_tier.py) in the scheduler: a request whose stored prefix is
being fetched waits in the queue while every other request's steps go on (a slow store costs no
one else a step), is admitted with the fetched pages once the fetch ends, or without them once its
wait ran out (counted; a later fetch is refused while that one still hangs). Under TP the ranks
load the least any of them fetched, each its own head slice (keys and pool per rank)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.store_keys import StoreNamespace, encode_page
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_rank import RankStore
from kvpipe.cache.store_tier import StoreTier, TierSettings
from kvpipe.config import SchedulerConfig
from kvpipe.engine.batch import ForwardMode
from kvpipe.engine.request import Req, SamplingParams
from kvpipe.engine.scheduler import Scheduler
from tests.helpers.memory_store import MemoryStore
from tests.helpers.scheduler_steps import step

PS, PAGES, HEADS, DIM = 4, 64, 2, 8


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def wait_until(fn: Callable[[], bool]) -> None:
    for _ in range(1000):  # a thread of the tier (bounded: 10 s)
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError("the tier's thread did not get there")


def req(rid: str, n: int, first: int, max_new: int) -> Req:
    """A prompt of tokens first, first + 1, ... (distinct prompts share no page)."""
    return Req(rid, list(range(first, first + n)), SamplingParams(max_new_tokens=max_new))


def pool(fill: float) -> KVPool:
    p = KVPool(2, PAGES, PS, HEADS, DIM, dtype=torch.float32)
    for b in p.buffers():
        b.fill_(fill)
    return p


def ns(tp_rank: int = 0, tp_size: int = 1) -> StoreNamespace:
    return StoreNamespace("cd" * 32, "torch.float32", PS, 4, HEADS, DIM, tp_rank, tp_size)


def stored(store: MemoryStore, rank: RankStore, ids: Sequence[int], n: int, value: float) -> None:
    """Pages 0..n-1 of `ids` in the store under `rank`'s keys, every element `value`."""
    payload = np.full(rank._pages.payload_bytes // 4, value, dtype=np.float32).tobytes()
    for k in rank.keys(ids, 0, n):
        store.data[k] = encode_page(k, payload)


def scheduler(tier: StoreTier) -> Scheduler:
    s = Scheduler(SchedulerConfig(), PageAllocator(PAGES), PS, 4096, prefix_cache=RadixCache(PS))
    s.kv_tier = tier
    return s


def test_a_slow_store_delays_no_other_request() -> None:
    store, clock = MemoryStore(), Clock()
    p = pool(0.0)
    tier = StoreTier(ns(), PoolPages(p), lambda: store, TierSettings(fetch_timeout_s=1.0), clock)
    s = scheduler(tier)
    try:
        a = req("a", 10, 1, max_new=6)
        s.add(a)
        assert step(s, check=False) is None  # a's fetch (nothing stored) runs first
        wait_until(lambda: tier.rank.fetch_result("a") is not None)
        assert step(s, check=False).mode is ForwardMode.PREFILL  # type: ignore[union-attr]
        b = req("b", 21, 100, max_new=2)  # 5 whole pages in the 20 tokens a match looks at
        stored(store, tier.rank, b.input_ids, 5, 1.5)
        store.gate.clear()  # the store hangs from now on
        s.add(b)
        c = req("c", 4, 200, max_new=2)  # behind b in the queue; no whole page to fetch
        s.add(c)
        # b's fetch hangs: c passes it, and a decodes at every other step or more (as without a store)
        modes = [step(s, check=False).mode for _ in range(5)]  # type: ignore[union-attr]
        want = [ForwardMode.DECODE, ForwardMode.PREFILL, ForwardMode.DECODE, ForwardMode.DECODE, ForwardMode.DECODE]
        assert modes == want, modes
        assert tier.pending("b") and any(r is b for r in s.waiting) and c.finished and len(a.output_ids) == 5
        assert s.waiting_on_tier()
        store.gate.set()  # the store answers: b is admitted with its 5 stored pages
        wait_until(lambda: tier.rank.fetch_result("b") is not None)
        batch = step(s, check=False)
        assert batch is not None and batch.reqs[0] is b and batch.prefix_lens == [5 * PS]
        assert b.num_shared_pages == 5 and b.cached_tokens == 5 * PS and not s.waiting_on_tier()
        loaded = p.buffers()[0][b.pages[:5]]
        assert torch.equal(loaded, torch.full_like(loaded, 1.5))
        assert tier.stats()["pages_fetched"] == 5 and tier.stats()["fallbacks"] == {}
    finally:
        store.gate.set()
        tier.close()


def test_a_fetch_past_its_timeout_is_given_up_and_blocks_no_later_fetch() -> None:
    store, clock = MemoryStore(), Clock()
    tier = StoreTier(ns(), PoolPages(pool(0.0)), lambda: store, TierSettings(fetch_timeout_s=1.0), clock)
    s = scheduler(tier)
    try:
        b = req("b", 21, 100, max_new=1)  # done at its prefill
        stored(store, tier.rank, b.input_ids, 5, 1.5)
        store.gate.clear()
        s.add(b)
        assert step(s, check=False) is None and tier.pending("b")  # nothing runnable while it waits
        clock.t += 1.0  # its wait ran out: computed whole, counted
        batch = step(s, check=False)
        assert batch is not None and batch.reqs[0] is b and batch.prefix_lens == [0]
        assert tier.stats()["fallbacks"] == {"timeout": 1} and not tier.pending("b")
        d = req("d", 21, 300, max_new=1)  # the hung fetch still runs: d does not wait behind it
        stored(store, tier.rank, d.input_ids, 5, 2.5)
        s.add(d)
        assert step(s, check=False).reqs[0] is d  # type: ignore[union-attr]
        assert tier.stats()["fallbacks"] == {"timeout": 1, "busy": 1}
    finally:
        store.gate.set()
        tier.close()


class InProcessPeers:
    """TierPeers over RankStores in this process: what engine/store_tp.py's TPTierPeers does over
    the TP pipes (the same RankStore calls, in the same order)."""

    def __init__(self, ranks: list[RankStore]) -> None:
        self.ranks = ranks

    def fetch(self, rid: str, token_ids: Sequence[int], first: int, count: int) -> None:
        for r in self.ranks:
            r.start_fetch(rid, r.keys(token_ids, first, count))

    def fetched(self, rid: str) -> list[int | None]:
        return [r.fetch_result(rid) for r in self.ranks]

    def load(self, rid: str, pages: np.ndarray, skip: int) -> None:
        for r in self.ranks:
            r.write_fetched(rid, pages, skip)

    def drop(self, rid: str) -> None:
        for r in self.ranks:
            r.drop_fetch(rid)

    def store(self, token_ids: Sequence[int], pages: np.ndarray) -> None:
        for r in self.ranks:
            r.store_pages(token_ids, pages)


def test_tp_ranks_load_the_least_any_rank_fetched_each_its_own_slice() -> None:
    store = MemoryStore()
    p0, p1 = pool(0.0), pool(0.0)
    rank1 = RankStore(ns(1, 2), PoolPages(p1), lambda: store)
    tier = StoreTier(ns(0, 2), PoolPages(p0), lambda: store, TierSettings(), peers=InProcessPeers([rank1]))
    s = scheduler(tier)
    try:
        b = req("b", 21, 100, max_new=2)
        stored(store, tier.rank, b.input_ids, 5, 1.0)  # rank 0 has 5 pages in the store,
        stored(store, rank1, b.input_ids, 3, 2.0)  # rank 1 only 3: both load 3
        s.add(b)
        assert step(s, check=False) is None
        wait_until(lambda: tier.rank.fetch_result("b") is not None and rank1.fetch_result("b") is not None)
        batch = step(s, check=False)
        assert batch is not None and batch.prefix_lens == [3 * PS] and b.num_shared_pages == 3
        for p, v in ((p0, 1.0), (p1, 2.0)):  # each rank's own head slice
            got = p.buffers()[3][b.pages[:3]]
            assert torch.equal(got, torch.full_like(got, v))
        assert tier.stats()["pages_fetched"] == 3 and rank1.stats()["pages_fetched"] == 3
        # the finished request's pages are put by every rank under its own keys
        while not b.finished:
            step(s, check=False)
        wait_until(lambda: rank1.stats()["pages_put"] == 2)  # rank 0's 5 were all there already
        keys0, keys1 = tier.rank.keys(b.input_ids, 0, 5), rank1.keys(b.input_ids, 0, 5)
        assert set(keys0).isdisjoint(keys1) and all(k in store.data for k in keys0 + keys1)
    finally:
        rank1.close()
        tier.close()
