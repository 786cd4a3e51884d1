"""A KV tier shared by every server of a model: full prefix pages in a KV store (Mooncake Store).

SGLang's HiCache with a storage backend, for kvpipe's radix cache (`--enable-hierarchical-cache
--hicache-storage-backend mooncake`). The scheduler calls it on the engine's thread (rank 0):

- `ready(rid, ids, cache, allocator)` before it matches a waiting prompt in the radix cache. The
  first call starts a prefetch of the pages past the radix match (the longest run of them the store
  holds) on every TP rank's fetch thread and returns False: the request stays queued while other
  requests' steps run (SGLang prefetches while a request waits in its queue). A later call returns
  True once every rank's fetch ended, or `fetch_timeout_s` passed (then nothing is loaded): the
  ranks agree on the number of pages to load (the least any rank fetched, so every rank's prefill
  computes the same suffix), rank 0 allocates them, every rank writes its own head slice into them,
  and they are inserted into the radix cache, where the match that follows finds them.
- `store_prefix(ids, pages)` after a finished request's full pages entered the radix cache: each
  rank copies the pages whose keys it has not stored yet off its pool now (their pool pages may be
  reused later) and queues them; its put thread writes the ones the store lacks. A full queue drops
  the batch: a put is never on a request's path.
- `forget(rid)` when a request finishes (an abort while it prefetched among them).

Per-rank work (keys, fetch and put threads, health, counters) is cache/store_rank.py's RankStore;
rank 0 reaches the other ranks' through TierPeers (engine/store_tp.py, over the TP group's
pipes). Failure rules: see store_rank.py; a store that is slow or down costs a request at most
fetch_timeout_s in the queue and never another request's step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache, RadixNode
from kvpipe.cache.store_client import KVStore
from kvpipe.cache.store_keys import StoreNamespace
from kvpipe.cache.store_rank import Fallback, PageIO, RankStore, TierSettings

__all__ = ["Fallback", "PageIO", "StoreTier", "TierPeers", "TierSettings"]


class TierPeers(Protocol):
    """TP ranks 1..N-1's RankStores, driven by rank 0 (engine/store_tp.py)."""

    def fetch(self, rid: str, token_ids: Sequence[int], first: int, count: int) -> None: ...

    def fetched(self, rid: str) -> list[int | None]:
        """Each rank's RankStore.fetch_result(rid)."""
        ...

    def load(self, rid: str, pages: np.ndarray, skip: int) -> None: ...

    def drop(self, rid: str) -> None: ...

    def store(self, token_ids: Sequence[int], pages: np.ndarray) -> None: ...


@dataclass
class _Prefetch:
    first: int  # pages of the prompt the radix cache held when it started
    keys: list[str]  # rank 0's keys of the pages fetched: [first, first + len(keys))
    cache: RadixCache
    node: RadixNode  # where the match ended: locked while the fetch runs (its pages stay)
    deadline: float


class StoreTier:
    def __init__(
        self,
        ns: StoreNamespace,
        pages: PageIO,
        connect: Callable[[], KVStore],
        settings: TierSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        peers: TierPeers | None = None,
    ) -> None:
        self.ns = ns
        self.settings = settings = settings or TierSettings()
        self.rank = RankStore(ns, pages, connect, settings, clock)
        self.peers = peers
        self._clock = clock
        self._pending: dict[str, _Prefetch] = {}  # prefetching requests
        self._settled: set[str] = set()  # requests whose prefetch is over (until forget)
        self._misses: OrderedDict[str, float] = OrderedDict()  # first missing key -> when
        self._stuck: Future | None = None  # a fetch that outlived its wait and still runs

    # ---- engine thread -----------------------------------------------------------------------
    def ready(self, rid: str, token_ids: Sequence[int], cache: RadixCache, allocator: PageAllocator) -> bool:
        """False while `rid` waits for stored pages extending `cache`'s match of `token_ids`; True
        when it may match now (they were loaded into `cache`, or there were none, or it gave up)."""
        if rid in self._settled:
            return True
        p = self._pending.get(rid)
        if p is None:
            if self._begin(rid, token_ids, cache, allocator):
                return False
            self._settled.add(rid)
            return True
        n = self._agreed(rid)
        if n is None:
            if self._clock() < p.deadline:
                return False
            self.rank.count_fallback(Fallback.TIMEOUT)
            self._end(rid, stuck=True)
        else:
            self._load(rid, p, token_ids, allocator, n)
        self._settled.add(rid)
        return True

    def pending(self, rid: str) -> bool:
        """`rid` waits for its prefetch."""
        return rid in self._pending

    def forget(self, rid: str) -> None:
        """`rid` finished: drop its prefetch if one runs."""
        self._settled.discard(rid)
        if rid in self._pending:
            self._end(rid)

    def store_prefix(self, token_ids: Sequence[int], pages: np.ndarray) -> None:
        """Queue the whole pages of `token_ids` (pages[i] holds page i) the store may lack, on
        every rank."""
        if self.rank.store_pages(token_ids, pages) and self.peers is not None:
            self.peers.store(list(token_ids[: len(pages) * self.ns.page_size]), np.asarray(pages))

    def stats(self) -> dict:
        """Rank 0's counters (every rank fetches and puts the same pages, its own head slice)."""
        return {**self.rank.stats(), "prefetching": len(self._pending)}

    def close(self, timeout_s: float = 5.0) -> None:
        self.rank.close(timeout_s)

    # ---- prefetch ----------------------------------------------------------------------------
    def _begin(self, rid: str, token_ids: Sequence[int], cache: RadixCache, allocator: PageAllocator) -> bool:
        """Start fetching the pages past `cache`'s match on every rank; False: nothing to fetch."""
        ps = self.ns.page_size
        n_full = len(token_ids) // ps
        have, node = cache.match(token_ids[: n_full * ps])
        m = len(have)
        room = min(n_full - m, allocator.num_free)
        if room < self.settings.min_fetch_pages or not self.rank.usable():
            return False
        keys = self.rank.keys(token_ids, m, room)
        missed = self._misses.get(keys[0])
        if missed is not None and self._clock() - missed < self.settings.miss_ttl_s:
            return False
        if self._stuck is not None:
            if not self._stuck.done():
                self.rank.count_fallback(Fallback.BUSY)
                return False
            self._stuck = None
        cache.lock(node)
        self.rank.start_fetch(rid, keys)
        if self.peers is not None:
            self.peers.fetch(rid, list(token_ids[: (m + room) * ps]), m, room)
        self._pending[rid] = _Prefetch(m, keys, cache, node, self._clock() + self.settings.fetch_timeout_s)
        return True

    def _agreed(self, rid: str) -> int | None:
        """Pages every rank fetched for `rid` (the least of them); None while one still fetches."""
        own = self.rank.fetch_result(rid)
        if own is None or self.peers is None:
            return own
        theirs = self.peers.fetched(rid)
        if any(t is None for t in theirs):
            return None
        return min([own, *(t for t in theirs if t is not None)])

    def _load(self, rid: str, p: _Prefetch, token_ids: Sequence[int], allocator: PageAllocator, n: int) -> int:
        """Write `n` fetched pages (all ranks) into free pages and insert them into the cache."""
        del self._pending[rid]
        p.cache.unlock(p.node)
        ps = self.ns.page_size
        if n < len(p.keys):
            self._misses[p.keys[n]] = self._clock()
            while len(self._misses) > 1024:
                self._misses.popitem(last=False)
        # another request may have put some of these pages into the cache meanwhile: skip those
        have, _ = p.cache.match(token_ids[: (p.first + n) * ps])
        skip = len(have) - p.first  # >= 0: the pages up to p.first were locked
        k = min(n - skip, allocator.num_free)
        if k <= 0:
            self.rank.drop_fetch(rid)
            if self.peers is not None:
                self.peers.drop(rid)
            return 0
        new = allocator.alloc(k)
        self.rank.write_fetched(rid, new, skip)
        if self.peers is not None:
            self.peers.load(rid, new, skip)
        dup = p.cache.insert(token_ids[: (len(have) + k) * ps], np.concatenate([have, new]))
        if dup > len(have):  # (not expected: nothing ran between the match and the insert)
            allocator.free(new[: dup - len(have)])
        return k

    def _end(self, rid: str, stuck: bool = False) -> None:
        p = self._pending.pop(rid)
        p.cache.unlock(p.node)
        running = self.rank.drop_fetch(rid)
        if stuck and running is not None:
            self._stuck = running
        if self.peers is not None:
            self.peers.drop(rid)
