"""The radix cache of a hybrid model (Qwen3.5): KV pages plus recurrent-state snapshots, no tensors.

A prefix of a hybrid model is reusable only together with the conv + recurrent state of its
linear-attention layers after its last token. A node may therefore hold one snapshot: the id of
a StatePool slot (one slot covers every linear layer) from `snapshots`, the slots after the
running requests' ones. A node without one is a tombstone: its pages only serve descendants that
have one (SGLang's Mamba radix cache; a split always makes a tombstone, a state cannot be cut).

    m = cache.match_state(ids)      # KV match, cut back to the deepest node with a snapshot
    cache.lock(m.node) ...          # pins the pages on the path and that node's snapshot
    dup, n = cache.insert_state(ids, pages, {pos: slot})   # pages up to the deepest snapshot
    slot, freed = cache.alloc_snapshot(rid)                # may evict one (and pages with it)

Sizing and eviction keep pages and snapshots together: `insert_state` caches pages only up to
the deepest snapshot it is given (pages past it could never be hit); page eviction takes
tombstone leaves first and frees a leaf's snapshot with its pages; snapshot eviction
(`evict_snapshot`, when the slots run out) tombstones the least recently used unpinned node and
removes what became an unreachable leaf chain. `evict` / `evict_snapshot` return page ids for the
PageAllocator; snapshot slots go straight back to `snapshots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpipe.cache.radix_cache import RadixCache, RadixNode
from kvpipe.cache.recurrent_slots import StateSlotAllocator


@dataclass(frozen=True)
class StateMatch:
    pages: np.ndarray  # the pages of the usable prefix: up to `node`
    node: RadixNode  # deepest node on the matched path with a snapshot (the root: nothing usable)
    kv_tokens: int  # tokens the KV alone matched (>= the usable prefix): where a new snapshot pays

    @property
    def snapshot(self) -> int | None:
        return self.node.snapshot


class HybridRadixCache(RadixCache):
    def __init__(self, page_size: int, snapshots: StateSlotAllocator, split_rows: bool = True) -> None:
        """`split_rows`: snapshots may be taken inside a forward's row (--mamba-scheduler-strategy
        extra_buffer); False: only where a row ends (no_buffer)."""
        super().__init__(page_size)
        self.snapshots = snapshots
        self.split_rows = split_rows
        self.num_snapshots = 0  # snapshots the tree holds (the rest of `snapshots` is with requests)

    # ---- lookups -------------------------------------------------------------------------------
    def match_state(self, token_ids: Sequence[int]) -> StateMatch:
        """The longest cached prefix of `token_ids` that ends at a snapshot (a KV match ending at a
        tombstone falls back to its deepest ancestor with one, or to nothing)."""
        pages, node = self.match(token_ids)
        kv_tokens = len(pages) * self.page_size
        while node is not self.root and node.snapshot is None:
            assert node.parent is not None
            node = node.parent
        return StateMatch(pages[: self.depth(node)], node, kv_tokens)

    def depth(self, node: RadixNode) -> int:
        """Pages from the root to the end of `node`."""
        return sum(n.num_pages for n in self._path(node))

    # ---- insert --------------------------------------------------------------------------------
    def insert_state(self, token_ids: Sequence[int], pages: np.ndarray, snaps: dict[int, int]) -> tuple[int, int]:
        """Cache the pages of `token_ids` up to the deepest snapshot in `snaps` (token position ->
        slot holding the state after that many tokens; positions page-aligned and within pages) and
        hang each snapshot on the node ending there. Returns (dup, n): of the first n pages cached,
        the caller frees its own ids of the first `dup` (as RadixCache.insert) and of pages[n:].
        Every slot in `snaps` is the cache's afterwards (kept, or freed as a duplicate)."""
        ps = self.page_size
        if any(pos % ps or pos <= 0 or pos > len(pages) * ps for pos in snaps):
            raise ValueError(f"snapshot positions {sorted(snaps)} are not whole pages within {len(pages)} pages")
        n = max(snaps, default=0) // ps
        dup = self.insert(token_ids[: n * ps], pages[:n])
        for pos, slot in sorted(snaps.items()):
            _, node = self.match(token_ids[:pos])  # splits the edge so that a node ends at pos
            assert self.depth(node) * ps == pos
            if node.snapshot is None:
                node.snapshot = slot
                self.num_snapshots += 1
            else:  # another request cached this state meanwhile
                self.snapshots.free(slot)
        return dup, n

    # ---- snapshot slots ------------------------------------------------------------------------
    def alloc_snapshot(self, owner: str) -> tuple[int | None, np.ndarray]:
        """A snapshot slot for request `owner` (None: all are pinned), evicting the least recently
        used unpinned one when none is free; also the page ids that eviction freed."""
        freed = np.zeros(0, dtype=np.int64)
        if self.snapshots.num_free == 0:
            freed = self.evict_snapshot()
        return self.snapshots.alloc(owner), freed

    def evict_snapshot(self) -> np.ndarray:
        """Drop the least recently used snapshot no request pins; returns the pages of the leaf
        chain that it leaves unreachable (maybe none: inner nodes keep their pages)."""
        nodes = [n for n in self._nodes() if n.snapshot is not None and n.refs == 0]
        if not nodes:
            return np.zeros(0, dtype=np.int64)
        # ties (a path touched at once): the deepest first, a leaf before the inner node above it
        node = min(nodes, key=lambda n: (n.last_access, bool(n.children)))
        self._drop_snapshot(node)
        out = []
        while node is not self.root and not node.children and node.snapshot is None and node.refs == 0:
            parent = node.parent
            assert parent is not None
            out.append(node.pages)
            self.num_pages -= node.num_pages
            self._remove(node)
            node = parent
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _drop_snapshot(self, node: RadixNode) -> None:
        assert node.snapshot is not None
        self.snapshots.free(node.snapshot)
        node.snapshot = None
        self.num_snapshots -= 1

    # ---- eviction hooks ------------------------------------------------------------------------
    def _evict_order(self, leaf: RadixNode) -> tuple[int, ...]:
        # a tombstone leaf can never be hit: its pages go first
        return (leaf.snapshot is not None, leaf.last_access)

    def _remove(self, leaf: RadixNode) -> None:
        if leaf.snapshot is not None:  # a snapshot is useless without its pages
            self._drop_snapshot(leaf)
        super()._remove(leaf)

    def all_snapshots(self) -> list[int]:
        """Every snapshot slot the tree holds (for invariant checks)."""
        return [n.snapshot for n in self._nodes() if n.snapshot is not None]
