"""The engine's side of the KV tier (cache/store_tier.py): build it from the server's config and
hand it to the scheduler, which calls it where it matches and inserts radix-cache prefixes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_client import KVStore, MooncakeStoreClient, MooncakeStoreSpec
from kvpipe.cache.store_keys import StoreNamespace
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_rank import RankStore
from kvpipe.cache.store_tier import StoreTier, TierSettings
from kvpipe.cache.swa_radix_cache import SWARadixCache
from kvpipe.config import ServerConfig
from kvpipe.engine.scheduler import Scheduler
from kvpipe.engine.store_tp import TPTierPeers
from kvpipe.engine.tp_group import TPGroup
from kvpipe.model.identity import checkpoint_digest

logger = logging.getLogger(__name__)


def store_namespace(cfg: ServerConfig, pool: KVPool, tp_rank: int = 0) -> StoreNamespace:
    return StoreNamespace(
        model_digest=checkpoint_digest(cfg.model_path),
        kv_dtype=str(pool.dtype),
        page_size=pool.page_size,
        num_buffers=len(pool.buffers()),
        kv_heads=pool.kv_heads,
        head_dim=pool.head_dim,
        tp_rank=tp_rank,
        tp_size=cfg.tp_size,
    )


def _connect_and_settings(cfg: ServerConfig) -> tuple[Callable[[], KVStore], TierSettings]:
    h = cfg.hicache
    assert h.mooncake_master is not None  # HiCacheConfig checked it
    spec = MooncakeStoreSpec(
        master=h.mooncake_master,
        metadata_server=h.mooncake_metadata_server,
        local_hostname=cfg.disaggregation.host or cfg.host,
        global_segment_bytes=h.mooncake_global_segment_bytes,
        local_buffer_bytes=h.mooncake_local_buffer_bytes,
        protocol=h.mooncake_protocol,
        device=h.mooncake_device,
    )

    def connect() -> KVStore:
        return MooncakeStoreClient(spec)

    # a batch staged in the client's local buffer must fit it (half: gets and puts run at once)
    settings = TierSettings(
        fetch_timeout_s=h.fetch_timeout_s, retry_s=h.retry_s, max_batch_bytes=h.mooncake_local_buffer_bytes // 2
    )
    return connect, settings


def rank_store(cfg: ServerConfig, pool: KVPool, tp_rank: int) -> RankStore:
    """TP rank `tp_rank`'s (>= 1) side of the tier: its own client, keys and head slice
    (engine/store_tp.py's RankTier makes it when rank 0 first asks)."""
    connect, settings = _connect_and_settings(cfg)
    return RankStore(store_namespace(cfg, pool, tp_rank), PoolPages(pool), connect, settings)


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
    connect, settings = _connect_and_settings(cfg)
    ns = store_namespace(cfg, pool)
    peers = TPTierPeers(tp) if tp is not None and cfg.tp_size > 1 else None
    if peers is not None:
        peers.start()  # the other ranks connect now, not inside the first request's wait
    tier = StoreTier(ns, PoolPages(pool), connect, settings, peers=peers)
    scheduler.kv_tier = tier
    logger.info("KV tier on Mooncake Store %s (keys %s...)", h.mooncake_master, ns.key_prefix())
    return tier
