"""The KV tier under tensor parallelism: rank 0's StoreTier (cache/store_tier.py) drives every other
rank's RankStore (cache/store_rank.py) over the TP group's pipes (engine/tp_group.py, TierMsg).

Each rank fetches and puts its own head slice under its own keys (the namespace names the TP
rank). Rank 0 has the ranks make their RankStores when its tier starts (`TierStart`), then decides:
it tells them which pages of a prompt to fetch (`TierFetch`), asks how many each got once its own
fetch ended (`TierFetched`, answered between forwards), and then every rank writes the least of
those counts into the same pool pages (`TierLoad`), so the prefill computes the same suffix on
every rank; or they drop what they fetched (`TierDrop`). A finished request's pages are copied off
every rank's pool (`TierStore`) before a later forward can reuse them: the pipe carries commands
and forwards in the order rank 0 sent them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from kvpipe.cache.kv_pool import KVPool
from kvpipe.cache.store_rank import RankStore
from kvpipe.config import ServerConfig

if TYPE_CHECKING:
    from kvpipe.engine.tp_group import TPGroup

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


class TPTierPeers:
    """Rank 0's TierPeers: ranks 1..N-1 of `tp`."""

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


class RankTier:
    """A TP child's side: its RankStore (made at the first command: only a server whose rank 0
    keeps the tier on sends any) and the commands rank 0 sends it."""

    def __init__(self, cfg: ServerConfig, pool: KVPool, rank: int) -> None:
        self._cfg, self._pool, self._rank = cfg, pool, rank
        self._store: RankStore | None = None

    def handle(self, cmd: object) -> object:
        if self._store is None:
            from kvpipe.engine.store_setup import rank_store  # the engine's imports, only with the tier on

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
