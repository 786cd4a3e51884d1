"""The engine's side of the KV tier (cache/store_tier.py): build it from the server's config and
hand it to the scheduler, which calls it where it matches and inserts radix-cache prefixes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import numpy as np

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_tier import StoreTier
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import ServerConfig
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.store_tp import (
    REPLY_TIMEOUT_S,
    TierDrop,
    TierFetch,
    TierFetched,
    TierLoad,
    TierStart,
    TierStore,
    connect_and_settings,
    store_namespace,
)
from kvpipe.engine.tp_group import TPGroup

logger = logging.getLogger(__name__)


class TPTierPeers:
    """Rank 0's TierPeers: ranks 1..N-1 of `tp` (engine/store_tp.py: the messages and their side)."""

    def __init__(self, tp: TPGroup) -> None:
        self._tp = tp

    def start(self) -> None:
        self._tp.tier_command(TierStart(), reply=False)

    def fetch(self, rid: str, token_ids: Sequence[int], first: int, count: int) -> None:
        self._tp.tier_command(TierFetch(rid, list(token_ids), first, count), reply=False)

    def fetched(self, rid: str) -> list[int | None]:
        self._tp.tier_command(TierFetched(rid), reply=True)
        return [None if r is None else int(cast(int, r)) for r in self._tp.replies(REPLY_TIMEOUT_S)]

    def load(self, rid: str, pages: np.ndarray, skip: int) -> None:
        self._tp.tier_command(TierLoad(rid, np.asarray(pages, dtype=np.int64), skip), reply=False)

    def drop(self, rid: str) -> None:
        self._tp.tier_command(TierDrop(rid), reply=False)

    def store(self, token_ids: Sequence[int], pages: np.ndarray) -> None:
        self._tp.tier_command(TierStore(list(token_ids), np.asarray(pages, dtype=np.int64)), reply=False)


def attach_store_tier(
    cfg: ServerConfig, pool: KVPool, scheduler: Scheduler, tp: TPGroup | None = None
) -> StoreTier | None:
    """The tier of `cfg.hicache` given to `scheduler` (None when off, or when this model's prefix
    cache cannot use it). With TP (`tp`: rank 0's group) every rank stores its own head slice."""
    h = cfg.hicache
    if not h.enabled:
        return None
    if scheduler.cache is None:  # a PD decode without its radix cache
        logger.info(
            "the KV tier is off on this server: it keeps no radix cache (a PD decode needs "
            "--disaggregation-enable-decode-radix-cache)"
        )
        return None
    if isinstance(scheduler.cache, HybridRadixCache):
        logger.warning("the KV tier is off for %s: a hybrid model's prefix needs its recurrent state", cfg.model_path)
        return None
    if isinstance(scheduler.cache, SWARadixCache):
        logger.warning(
            "the KV tier is off for %s: a sliding-window model's prefix needs its window pages", cfg.model_path
        )
        return None
    connect, settings = connect_and_settings(cfg)
    ns = store_namespace(cfg, pool)
    peers = TPTierPeers(tp) if tp is not None and cfg.tp_size > 1 else None
    if peers is not None:
        peers.start()  # the other ranks connect now, not inside the first request's wait
    tier = StoreTier(ns, PoolPages(pool), connect, settings, peers=peers)
    scheduler.kv_tier = tier
    logger.info("KV tier on Mooncake Store %s (keys %s...)", h.mooncake_master, ns.key_prefix())
    return tier
