"""The KV tier's failure rules without a store (cache/store_tier.py): a store that cannot be reached
never costs a request anything but the compute, is counted and skipped for the retry interval, and
tried again after it; batched calls stay within the client's buffer."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.store_client import KVStore, StoreError
from kvpipe.cache.store_keys import StoreNamespace
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_tier import StoreTier, TierSettings

PS = 4


def wait_until(fn: Callable[[], bool]) -> None:
    for _ in range(500):  # the tier's fetch thread (bounded: 5 s)
        if fn():
            return
        time.sleep(0.01)
    raise AssertionError("the tier's fetch did not end")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_an_unreachable_store_falls_back_is_counted_and_retried() -> None:
    attempts: list[float] = []
    clock = Clock()

    def connect() -> KVStore:  # the master is not there (what MooncakeStoreClient raises)
        attempts.append(clock.t)
        raise StoreError("Mooncake Store setup with master 127.0.0.1:1 failed (-1)")

    pool = KVPool(2, 16, PS, 1, 8, dtype=torch.float32)
    ns = StoreNamespace("ab" * 32, "torch.float32", PS, 4, 1, 8)
    tier = StoreTier(ns, PoolPages(pool), connect, TierSettings(retry_s=5.0, max_batch_bytes=3 * 1024), clock)
    try:
        cache, alloc = RadixCache(PS), PageAllocator(16)
        ids = list(range(3, 23))  # 5 pages
        for _ in range(500):  # the put thread connects at start (bounded: 5 s)
            if attempts:
                break
            time.sleep(0.01)
        assert attempts == [100.0]
        assert tier.ready("r1", ids, cache, alloc)  # inside the retry interval: skipped, nothing to wait for
        assert tier.stats()["fallbacks"] == {"down": 1} and alloc.num_free == 16 and cache.num_pages == 0
        tier.store_prefix(ids, np.arange(5))
        assert tier.stats()["puts_dropped"] == {"down": 5} and tier.stats()["put_queue"] == 0
        clock.t += 5.0  # the interval passed: the next fetch tries to connect again, fails, computes
        assert not tier.ready("r2", ids, cache, alloc)  # a fetch started: it tries to connect again
        wait_until(lambda: tier.ready("r2", ids, cache, alloc))  # fails: nothing loaded, computed
        assert attempts == [100.0, 105.0] and tier.stats()["fallbacks"] == {"down": 1, "error": 1}
        assert not tier.stats()["up"] and alloc.num_free == 16
        # 3 KiB batches of 2 x 2 x 4 x 8 x 4 = 512-byte pages (+ a record header): 3 pages each
        assert tier.rank._batches(7) == [(0, 3), (3, 6), (6, 7)]
    finally:
        tier.close()
