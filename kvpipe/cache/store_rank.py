"""One TP rank's side of the KV tier (cache/store_tier.py): its store client, its keys (its own head
slice), its pool pages as bytes, and the two threads that talk to the store.

Every rank of a server has one: rank 0's StoreTier owns its rank's and drives the others' through
the TP group (engine/store_tp.py), so each rank fetches and puts the head slice its own pool
holds under its own keys (StoreNamespace names the TP rank). Nothing here decides which pages a
request loads: a fetch runs on the rank's fetch thread and its checked payloads wait here, by
request id, until rank 0 says how many of them to write into which pool pages (the same number on
every rank) or to drop them.

Failure rules: a failed call makes the rank skip the store for `retry_s` (`usable()` is False),
logs once per outage, counts each fallback by reason, and tries again after that (the Mooncake
client reconnects to a restarted master by itself; a client that never connected is created
again). A page whose record does not check out is rejected (counted) and ends the fetched run there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np

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
    fetch_timeout_s: float = 1.0  # the longest a prompt waits (in the queue) for the store
    put_queue: int = 64  # finished requests' page batches waiting for the put thread
    retry_s: float = 5.0  # after a failure, the store is skipped this long
    min_fetch_pages: int = 1  # fetch only runs past the radix match of at least this many pages
    miss_ttl_s: float = 2.0  # a prompt whose next page the store lacked is not asked again for this long
    known_keys: int = 1 << 16  # keys remembered as stored (not queued again)
    # bytes of one batched put or get: Mooncake stages a batch in the client's local buffer and
    # refuses one larger than it (measured: 64 x 2.9 MB pages into a 64 MiB buffer)
    max_batch_bytes: int = 32 << 20


@dataclass
class _Fetch:
    keys: list[str]
    future: Future  # -> the checked payloads of the longest stored run of keys, None: the store failed


class RankStore:
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
        self._lock = threading.Lock()  # the fields below, shared with the threads
        self._connecting = threading.Lock()
        self._up = True  # False from a failure until a call succeeds again (one log line per outage)
        self._retry_at = 0.0
        self._known: OrderedDict[str, None] = OrderedDict()  # keys stored (or queued) by us, LRU
        self.pages_fetched = 0
        self.pages_put = 0
        self.pages_rejected = 0
        self.fallbacks: Counter[str] = Counter()
        self.puts_dropped: Counter[str] = Counter()
        self._fetch_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-store-fetch")
        self._fetches: dict[str, _Fetch] = {}  # request id -> its fetch (the caller's thread only)
        self._puts: queue.Queue[tuple[list[str], Sequence[bytes | memoryview]] | None] = queue.Queue(settings.put_queue)
        self._put_thread = threading.Thread(target=self._put_loop, name="kv-store-put", daemon=True)
        self._put_thread.start()

    # ---- the caller's thread (a rank's engine or TP loop) ------------------------------------
    def keys(self, token_ids: Sequence[int], first: int, count: int) -> list[str]:
        """This rank's keys of pages [first, first + count) of `token_ids`."""
        end = (first + count) * self.ns.page_size
        return page_keys(self.ns, token_ids[:end], self._root)[first : first + count]

    def start_fetch(self, rid: str, keys: list[str]) -> None:
        """Fetch (on the fetch thread) the longest run of `keys` the store holds, for `rid`."""
        self.drop_fetch(rid)
        self._fetches[rid] = _Fetch(keys, self._fetch_pool.submit(self._fetch, keys))

    def fetch_result(self, rid: str) -> int | None:
        """Checked pages `rid`'s fetch got; None while it runs (0: none, failed, or no fetch)."""
        f = self._fetches.get(rid)
        if f is None:
            return 0
        if not f.future.done():
            return None
        err = f.future.exception()
        if err is not None:  # not a store failure (those return None): a bug, computed instead
            logger.warning("KV store: a fetch failed: %r", err)
            return 0
        got = f.future.result()
        return 0 if got is None else len(got)

    def write_fetched(self, rid: str, pages: np.ndarray, skip: int = 0) -> None:
        """Write `rid`'s fetched payloads [skip, skip + len(pages)) into pool `pages`; forget it."""
        f = self._fetches.pop(rid, None)
        if f is None or len(pages) == 0:
            return
        got = f.future.result() or []
        if len(got) < skip + len(pages):
            raise ValueError(f"{len(pages)} pages to load from {len(got)} fetched (skipping {skip}) for {rid}")
        self._pages.write(pages, got[skip : skip + len(pages)])
        with self._lock:
            self.pages_fetched += len(pages)
            self._remember(f.keys[skip : skip + len(pages)])

    def drop_fetch(self, rid: str) -> Future | None:
        """Forget `rid`'s fetch; returns it if it still runs (its result is thrown away)."""
        f = self._fetches.pop(rid, None)
        return f.future if f is not None and not f.future.done() else None

    def store_pages(self, token_ids: Sequence[int], pages: np.ndarray) -> bool:
        """Queue the whole pages of `token_ids` (pages[i] holds page i) the store may lack; False
        when there were none new (or the store is skipped now)."""
        if len(pages) == 0 or not self.usable(pages=len(pages)):
            return False
        keys = self.keys(token_ids, 0, len(pages))
        with self._lock:
            new = [i for i, k in enumerate(keys) if k not in self._known]
            if not new:
                return False
            self._remember([keys[i] for i in new])  # queued once, by whichever request came first
        payloads = self._pages.read(np.asarray(pages)[new])  # a copy: the pages may be reused later
        try:
            self._puts.put_nowait(([keys[i] for i in new], payloads))
        except queue.Full:
            with self._lock:
                self.puts_dropped["queue_full"] += len(new)
                for i in new:
                    self._known.pop(keys[i], None)
        return True

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
    def usable(self, pages: int = 0) -> bool:
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

    def count_fallback(self, why: Fallback) -> None:
        with self._lock:
            self.fallbacks[why.value] += 1

    def _failed(self, what: str, err: Exception) -> None:
        with self._lock:
            self._retry_at = self._clock() + self.settings.retry_s
            was_up, self._up = self._up, False
            self._known.clear()  # a restarted store holds none of what we stored: put it again
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

    # ---- the rank's threads ------------------------------------------------------------------
    def _batches(self, n: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of n pages, each batch within max_batch_bytes (at least one page)."""
        per = max(1, self.settings.max_batch_bytes // max(1, self._pages.payload_bytes + 512))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _fetch(self, keys: list[str]) -> list[memoryview] | None:
        """The checked payloads of the longest run of `keys` the store holds (fetch thread); None
        when the store failed."""
        store = self._client()
        if store is None:
            self.count_fallback(Fallback.ERROR)
            return None
        try:
            held = store.exists(keys)
            run = next((i for i, h in enumerate(held) if not h), len(held))
            blobs: list[bytes] = []
            for lo, hi in self._batches(run):
                blobs += store.get(keys[lo:hi])
        except Exception as e:
            self._failed("fetch", e)
            self.count_fallback(Fallback.ERROR)
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
