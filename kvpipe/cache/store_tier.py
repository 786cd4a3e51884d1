"""A KV tier shared by every server of a model: full prefix pages in a KV store (Mooncake Store).

SGLang's HiCache with a storage backend, for kvpipe's radix cache (`--enable-hierarchical-cache
--hicache-storage-backend mooncake`). The scheduler calls two hooks, both on the engine's thread:

- `load_prefix(ids, cache, allocator)` before it matches a prompt in the radix cache: the pages
  past the radix cache's match whose keys the store holds (the longest run of them) are fetched,
  checked (cache/store_keys.py: key and digest), written into freshly allocated free pages and
  inserted into the radix cache, so the match that follows finds them and the prefill computes
  only the rest. The fetch runs on the tier's fetch thread; the engine waits for it at most
  `fetch_timeout_s`.
- `store_prefix(ids, pages)` after a finished request's full pages entered the radix cache: the
  pages whose keys it has not stored yet are copied off the pool now (their pool pages may be
  reused later) and queued; the tier's put thread writes the ones the store lacks. A full queue
  drops the batch: a put is never on a request's path.

Failure rules: a store that is down, slow, full or answers garbage never fails a request. A failed
call makes the tier skip the store (everything is computed, as without it) for `retry_s`, logs once
per outage, counts each fallback by reason, and tries again after that (the Mooncake client
reconnects to a restarted master by itself; a client that never connected is created again). A
page whose record does not check out is rejected (counted) and ends the fetched run there.

Bookkeeping is here (keys, runs, queues, counters); the bytes come and go through PoolPages
(cache/store_pages.py, the only part with tensors) and the store through a KVStore (cache/store_client.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np

from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixCache
from kvpipe.cache.store_client import KVStore
from kvpipe.cache.store_keys import StoreNamespace, decode_page, encode_page, page_keys

logger = logging.getLogger(__name__)


class PageIO(Protocol):
    """Pool pages as payload bytes and back (cache/store_pages.py's PoolPages)."""

    payload_bytes: int

    def read(self, pages: np.ndarray) -> Sequence[bytes | memoryview]: ...

    def write(self, pages: np.ndarray, payloads: Sequence[bytes | memoryview]) -> None: ...


class Fallback(str, Enum):
    """Why a fetch computed instead of loading (the label of kvpipe_kv_store_fallbacks_total)."""

    DOWN = "down"  # the store failed recently: skipped until retry_s passed
    TIMEOUT = "timeout"  # the fetch took longer than fetch_timeout_s
    BUSY = "busy"  # an earlier fetch that timed out still runs
    ERROR = "error"  # a store call failed now


@dataclass(frozen=True)
class TierSettings:
    fetch_timeout_s: float = 1.0  # the longest a prefill waits for the store
    put_queue: int = 64  # finished requests' page batches waiting for the put thread
    retry_s: float = 5.0  # after a failure, the store is skipped this long
    min_fetch_pages: int = 1  # fetch only runs past the radix match of at least this many pages
    miss_ttl_s: float = 2.0  # a prompt whose next page the store lacked is not asked again for this long
    known_keys: int = 1 << 16  # keys remembered as stored (not queued again)
    # bytes of one batched put or get: Mooncake stages a batch in the client's local buffer and
    # refuses one larger than it (measured: 64 x 2.9 MB pages into a 64 MiB buffer)
    max_batch_bytes: int = 32 << 20


class StoreTier:
    def __init__(
        self,
        ns: StoreNamespace,
        pages: PageIO,
        connect: Callable[[], KVStore],
        settings: TierSettings = TierSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ns = ns
        self.settings = settings
        self._root = ns.digest()
        self._pages = pages
        self._connect = connect
        self._clock = clock
        self._store: KVStore | None = None
        self._lock = threading.Lock()  # the fields below, shared with the tier's threads
        self._connecting = threading.Lock()
        self._up = True  # False from a failure until a call succeeds again (one log line per outage)
        self._retry_at = 0.0
        self._known: OrderedDict[str, None] = OrderedDict()  # keys stored (or queued) by us, LRU
        self._misses: OrderedDict[str, float] = OrderedDict()  # first missing key -> when
        self.pages_fetched = 0
        self.pages_put = 0
        self.pages_rejected = 0
        self.fallbacks: Counter[str] = Counter()
        self.puts_dropped: Counter[str] = Counter()
        self._fetch_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-store-fetch")
        self._fetching: Future | None = None  # a fetch that outlived its wait
        self._puts: queue.Queue[tuple[list[str], Sequence[bytes | memoryview]] | None] = queue.Queue(settings.put_queue)
        self._put_thread = threading.Thread(target=self._put_loop, name="kv-store-put", daemon=True)
        self._put_thread.start()

    # ---- engine thread -----------------------------------------------------------------------
    def load_prefix(self, token_ids: Sequence[int], cache: RadixCache, allocator: PageAllocator) -> int:
        """Fetch the stored pages that extend `cache`'s match of `token_ids` into free pages and
        insert them into `cache`; returns how many (0: nothing stored, no room, or a fallback)."""
        ps = self.ns.page_size
        n_full = len(token_ids) // ps
        have, _ = cache.match(token_ids[: n_full * ps])
        m = len(have)
        room = min(n_full - m, allocator.num_free)
        if room < self.settings.min_fetch_pages or not self._usable():
            return 0
        keys = page_keys(self.ns, token_ids[: n_full * ps], self._root)[m : m + room]
        now = self._clock()
        with self._lock:
            missed = self._misses.get(keys[0])
            if missed is not None and now - missed < self.settings.miss_ttl_s:
                return 0
        if self._fetching is not None:
            if not self._fetching.done():
                self._count_fallback(Fallback.BUSY)
                return 0
            self._fetching = None
        fut = self._fetch_pool.submit(self._fetch, keys)
        try:
            payloads = fut.result(timeout=self.settings.fetch_timeout_s)
        except FutureTimeout:
            self._fetching = fut
            self._count_fallback(Fallback.TIMEOUT)
            return 0
        if payloads is None:  # the store failed (counted and logged by _fetch)
            return 0
        if len(payloads) < len(keys):
            with self._lock:
                self._misses[keys[len(payloads)]] = now
                while len(self._misses) > 1024:
                    self._misses.popitem(last=False)
        n = min(len(payloads), allocator.num_free)
        if n == 0:
            return 0
        new = allocator.alloc(n)
        self._pages.write(new, payloads[:n])
        dup = cache.insert(token_ids[: (m + n) * ps], np.concatenate([have, new]))
        if dup > m:  # (not expected: nothing ran between the match and the insert)
            allocator.free(new[: dup - m])
        with self._lock:
            self.pages_fetched += n
            self._remember(keys[:n])
        return n

    def store_prefix(self, token_ids: Sequence[int], pages: np.ndarray) -> None:
        """Queue the whole pages of `token_ids` (pages[i] holds page i) the store may lack."""
        if len(pages) == 0 or not self._usable(pages=len(pages)):
            return
        keys = page_keys(self.ns, token_ids[: len(pages) * self.ns.page_size], self._root)
        with self._lock:
            new = [i for i, k in enumerate(keys) if k not in self._known]
            if not new:
                return
            self._remember([keys[i] for i in new])  # queued once, by whichever request came first
        payloads = self._pages.read(np.asarray(pages)[new])
        try:
            self._puts.put_nowait(([keys[i] for i in new], payloads))
        except queue.Full:
            with self._lock:
                self.puts_dropped["queue_full"] += len(new)
                for i in new:
                    self._known.pop(keys[i], None)

    def stats(self) -> dict:
        with self._lock:
            return {
                "up": self._up,
                "pages_fetched": self.pages_fetched,
                "pages_put": self.pages_put,
                "pages_rejected": self.pages_rejected,
                "fallbacks": dict(self.fallbacks),
                "puts_dropped": dict(self.puts_dropped),
                "put_queue": self._puts.qsize(),
            }

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._puts.put(None, timeout=timeout_s)
        except queue.Full:
            pass  # the daemon thread dies with the process
        self._put_thread.join(timeout_s)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        store, self._store = self._store, None
        if store is not None:
            store.close()

    # ---- health ------------------------------------------------------------------------------
    def _usable(self, pages: int = 0) -> bool:
        """False while a recent failure's retry_s runs: counted as a fetch's fallback, or as
        `pages` pages of a put dropped."""
        with self._lock:
            if self._clock() >= self._retry_at:
                return True
            if pages:
                self.puts_dropped["down"] += pages
            else:
                self.fallbacks[Fallback.DOWN.value] += 1
            return False

    def _count_fallback(self, why: Fallback) -> None:
        with self._lock:
            self.fallbacks[why.value] += 1

    def _failed(self, what: str, err: Exception) -> None:
        with self._lock:
            self._retry_at = self._clock() + self.settings.retry_s
            was_up, self._up = self._up, False
            # a restarted store holds none of what we stored: put it again
            self._known.clear()
            self._misses.clear()
        if was_up:
            logger.warning(
                "KV store: %s failed (%s); computing instead, retrying every %g s", what, err, self.settings.retry_s
            )

    def _ok(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
        if not was_up:
            logger.warning("KV store: reachable again")

    def _client(self) -> KVStore | None:
        """The store client, connected on first use (and again after a failed connect)."""
        with self._connecting:
            if self._store is None:
                try:
                    self._store = self._connect()
                except Exception as e:
                    self._failed("connect", e)
                    return None
            return self._store

    def _remember(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > self.settings.known_keys:
            self._known.popitem(last=False)

    # ---- the tier's threads ------------------------------------------------------------------
    def _batches(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of n pages, each batch within max_batch_bytes (at least one page)."""
        per = max(1, self.settings.max_batch_bytes // max(1, self._pages.payload_bytes + 512))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _fetch(self, keys: list[str]) -> list[memoryview] | None:
        """The checked payloads of the longest run of `keys` the store holds (fetch thread); None
        when the store failed."""
        store = self._client()
        if store is None:
            self._count_fallback(Fallback.ERROR)
            return None
        try:
            held = store.exists(keys)
            run = next((i for i, h in enumerate(held) if not h), len(held))
            blobs: list[bytes] = []
            for lo, hi in self._batches(run):
                blobs += store.get(keys[lo:hi])
        except Exception as e:
            self._failed("fetch", e)
            self._count_fallback(Fallback.ERROR)
            return None
        self._ok()
        out: list[memoryview] = []
        for key, blob in zip(keys, blobs):
            payload = decode_page(key, blob, self._pages.payload_bytes) if blob else None
            if payload is None:
                if blob:  # there, but not a record of this key: corrupt, foreign or stale
                    with self._lock:
                        self.pages_rejected += 1
                        first = self.pages_rejected == 1
                    if first:  # once: a foreign writer would otherwise fill the log
                        logger.warning("KV store: rejected the page under %s (not a valid record of that key)", key)
                break  # evicted meanwhile, or rejected: the rest is computed
            out.append(payload)
        return out

    def _put_loop(self) -> None:
        self._client()  # connect now, not inside the first request's bounded fetch
        while True:
            item = self._puts.get()
            if item is None:
                return
            keys, payloads = item
            store = self._client()
            if store is None:
                with self._lock:
                    self.puts_dropped["down"] += len(keys)
                continue
            try:
                held = store.exists(keys)
            except Exception as e:
                self._failed("put", e)
                with self._lock:
                    self.puts_dropped["down"] += len(keys)
                continue
            self._ok()
            todo = [i for i, h in enumerate(held) if not h]
            if not todo:
                continue
            try:
                for lo, hi in self._batches(len(todo)):
                    part = todo[lo:hi]
                    store.put([keys[i] for i in part], [encode_page(keys[i], payloads[i]) for i in part])
            except Exception as e:  # reachable but refused (full): drop, the store stays in use
                logger.debug("KV store: put of %d pages refused: %s", len(todo), e)
                with self._lock:
                    self.puts_dropped["refused"] += len(todo)
                    for i in todo:
                        self._known.pop(keys[i], None)
                continue
            with self._lock:
                self.pages_put += len(todo)
