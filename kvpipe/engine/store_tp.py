"""The KV tier under tensor parallelism: rank 0's StoreTier (cache/store_tier.py) drives every other
rank's RankStore (cache/store_rank.py) over the TP group's pipes (engine/tp_group.py, TierMsg).

Each rank fetches and puts its own head slice under its own keys (the namespace names the TP
rank). Rank 0 has the ranks make their RankStores when its tier starts (`TierStart`), then decides:
it tells them which pages of a prompt to fetch (`TierFetch`), asks how many each got once its own
fetch ended (`TierFetched`, answered between forwards), and then every rank writes the least of
those counts into the same pool pages (`TierLoad`), so the prefill computes the same suffix on
every rank; or they drop what they fetched (`TierDrop`). A finished request's pages are copied off
every rank's pool (`TierStore`) before a later forward can reuse them: the pipe carries commands
and forwards in the order rank 0 sent them. Rank 0's end of these commands is
engine/store_setup.py's TPTierPeers; this module holds the messages and the children's side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_client import KVStore, MooncakeStoreClient, MooncakeStoreSpec
from kvpipe.cache.store_keys import StoreNamespace
from kvpipe.cache.store_pages import PoolPages
from kvpipe.cache.store_rank import RankStore
from kvpipe.cache.store_tier import TierSettings
from kvpipe.config import ServerConfig
from kvpipe.model.checkpoint.identity import checkpoint_digest

# a rank answers between forwards (its pipe carries nothing longer): anything slower is a dead rank
REPLY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TierStart:  # make the rank's RankStore now (it connects on its put thread), not at the first fetch
    pass


@dataclass(frozen=True)
class TierFetch:
    rid: str
    token_ids: list[int]  # the prompt's tokens up to the last page fetched
    first: int  # pages [first, first + count) of them
    count: int


@dataclass(frozen=True)
class TierFetched:  # reply: RankStore.fetch_result(rid)
    rid: str


@dataclass(frozen=True)
class TierLoad:
    rid: str
    pages: np.ndarray  # pool pages (the same on every rank) for fetched pages [skip, skip + len)
    skip: int


@dataclass(frozen=True)
class TierDrop:
    rid: str


@dataclass(frozen=True)
class TierStore:
    token_ids: list[int]
    pages: np.ndarray  # pages[i] holds page i of token_ids


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


def connect_and_settings(cfg: ServerConfig) -> tuple[Callable[[], KVStore], TierSettings]:
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
    (RankTier makes it when rank 0 first asks)."""
    connect, settings = connect_and_settings(cfg)
    return RankStore(store_namespace(cfg, pool, tp_rank), PoolPages(pool), connect, settings)


class RankTier:
    """A TP child's side: its RankStore (made at the first command: only a server whose rank 0
    keeps the tier on sends any) and the commands rank 0 sends it."""

    def __init__(self, cfg: ServerConfig, pool: KVPool, rank: int) -> None:
        self._cfg, self._pool, self._rank = cfg, pool, rank
        self._store: RankStore | None = None

    def handle(self, cmd: object) -> object:
        if self._store is None:
            self._store = rank_store(self._cfg, self._pool, self._rank)
        s = self._store
        if isinstance(cmd, TierStart):
            pass
        elif isinstance(cmd, TierFetch):
            s.start_fetch(cmd.rid, s.keys(cmd.token_ids, cmd.first, cmd.count))
        elif isinstance(cmd, TierFetched):
            return s.fetch_result(cmd.rid)
        elif isinstance(cmd, TierLoad):
            s.write_fetched(cmd.rid, cmd.pages, cmd.skip)
        elif isinstance(cmd, TierDrop):
            s.drop_fetch(cmd.rid)
        elif isinstance(cmd, TierStore):
            s.store_pages(cmd.token_ids, cmd.pages)
        else:
            raise TypeError(f"TP rank {self._rank}: unexpected KV tier command {type(cmd).__name__}")
        return None

    def close(self) -> None:
        if self._store is not None:
            self._store.close(timeout_s=1.0)
