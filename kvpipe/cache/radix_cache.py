"""A page-granular radix (prefix) cache over token ids: plain Python + numpy, no tensors.

Only whole pages are cached: a prefix of `page_size * k` tokens maps to the k KV pages that
hold it. Edges of the tree hold whole pages (`tokens` is a multiple of page_size long, `pages`
the matching page ids), and a node's children are keyed by their first page of tokens, so two
sequences share exactly their common page-aligned prefix.

Ownership: pages inserted into the cache belong to it; `evict` hands unreferenced ones back (the
caller returns them to the PageAllocator). A request that matched a prefix `lock`s the node it
matched, which pins every page on the path to the root until it `unlock`s: a page another request
still reads is never evicted. Eviction takes least recently used leaves first.

    pages, node = cache.match(ids)           # longest cached page-aligned prefix of ids
    cache.lock(node) ... cache.unlock(node)  # while a request reads those pages
    dup = cache.insert(ids, pages)           # cache a finished sequence's full pages; the caller
                                             # frees its own pages of the first `dup` pages (the
                                             # cache had them already)
    freed = cache.evict(n)                   # up to n unreferenced pages, LRU leaves first
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

Key = tuple[int, ...]  # one page of token ids
SALT_SHIFT = 32  # token ids are below 2**32 (the KV tier hashes them as 4-byte integers)


def salted(token_ids: Sequence[int], salt: str | None) -> Sequence[int]:
    """`token_ids` in the key space of a cache salt (a tenant's prefix namespace): each id lifted
    past every vocabulary by the salt's own 64-bit tag, so keys of two salts never match, nor
    unsalted ones; the caches only compare and slice them. Unchanged without a salt."""
    if salt is None:
        return token_ids
    tag = int.from_bytes(hashlib.sha256(b"kvpipe cache salt\0" + salt.encode()).digest()[:8], "little") | 1
    base = tag << SALT_SHIFT
    return [base + t for t in token_ids]


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...] = ()  # the edge from the parent: whole pages of token ids
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # one id per page
    parent: RadixNode | None = None
    children: dict[Key, RadixNode] = field(default_factory=dict)
    refs: int = 0  # requests holding a lock on this node or a descendant
    last_access: int = 0  # logical clock of the last match or insert through it
    # hybrid models (hybrid_radix_cache.py): the StatePool slot holding the recurrent state after
    # this node's last token; None: a tombstone (its pages serve only descendants that have one)
    snapshot: int | None = None
    # sliding-window models (swa_radix_cache.py): the sliding layers' page per page of `pages`, -1
    # where it slid out (a tombstone); None: none held
    swa_pages: np.ndarray | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode()
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the cache holds
        self.locked_pages = 0  # of which some request pins

    # ---- lookups -------------------------------------------------------------------------------
    def _key(self, tokens: Sequence[int], at: int) -> Key:
        return tuple(tokens[at : at + self.page_size])

    def match(self, token_ids: Sequence[int]) -> tuple[np.ndarray, RadixNode]:
        """Pages of the longest cached page-aligned prefix of `token_ids`, and the node where it
        ends (lock it while reading them). Splits an edge matched only in part."""
        ps, now = self.page_size, next(self._clock)
        usable = len(token_ids) - len(token_ids) % ps
        node, at, found = self.root, 0, []
        node.last_access = now
        while at < usable:
            child = node.children.get(self._key(token_ids, at))
            if child is None:
                break
            n = self._common_pages(child.tokens, token_ids, at)
            if n < child.num_pages:
                child = self._split(child, n)
            found.append(child.pages)
            child.last_access = now
            node, at = child, at + child.num_pages * ps
        pages = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        return pages, node

    def _common_pages(self, edge: tuple[int, ...], token_ids: Sequence[int], at: int) -> int:
        """Whole pages of `edge` equal to token_ids[at:] (at least the first, which matched the key)."""
        ps = self.page_size
        n = 1
        while (
            n * ps < len(edge)
            and at + (n + 1) * ps <= len(token_ids)
            and edge[n * ps : (n + 1) * ps] == tuple(token_ids[at + n * ps : at + (n + 1) * ps])
        ):
            n += 1
        return n

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut `child`'s edge after n pages; returns the new upper node (same refs: every lock
        below the cut also pins the part above it)."""
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < n < child.num_pages
        upper = RadixNode(child.tokens[: n * ps], child.pages[:n], parent, {}, child.refs, child.last_access)
        parent.children[self._key(child.tokens, 0)] = upper
        child.tokens, child.pages, child.parent = child.tokens[n * ps :], child.pages[n:], upper
        upper.children[self._key(child.tokens, 0)] = child
        return upper

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: np.ndarray) -> int:
        """Cache the whole pages of a sequence: pages[i] holds tokens [i*ps, (i+1)*ps). Returns how
        many leading pages the cache had already (the caller keeps ownership of those ids in
        `pages` and frees them; the cache keeps its own). The rest now belong to the cache."""
        ps = self.page_size
        n_pages = min(len(token_ids) // ps, len(pages))
        pages = np.asarray(pages, dtype=np.int64)[:n_pages]
        have, node = self.match(token_ids[: n_pages * ps])
        dup = len(have)
        if dup < n_pages:
            now = next(self._clock)
            tokens = tuple(token_ids[dup * ps : n_pages * ps])
            leaf = RadixNode(tokens, pages[dup:].copy(), node, {}, 0, now)
            node.children[self._key(tokens, 0)] = leaf
            self.num_pages += n_pages - dup
        return dup

    # ---- locks ---------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Pin every page from `node` up to the root (a request reads them)."""
        for n in self._path(node):
            if n.refs == 0:
                self.locked_pages += n.num_pages
            n.refs += 1

    def unlock(self, node: RadixNode) -> None:
        for n in self._path(node):
            if n.refs <= 0:
                raise ValueError("unlock of a node that is not locked")
            n.refs -= 1
            if n.refs == 0:
                self.locked_pages -= n.num_pages

    def _path(self, node: RadixNode) -> Iterator[RadixNode]:
        while node is not self.root and node.parent is not None:
            yield node
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self.locked_pages

    def evict(self, num_pages: int) -> np.ndarray:
        """Remove up to `num_pages` unreferenced pages (least recently used leaves first, whole
        leaves at a time, so possibly a few more) and return their ids for the allocator."""
        out: list[np.ndarray] = []
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            # a parent becomes a leaf only after its children go: recompute after each round
            for leaf in sorted(leaves, key=self._evict_order):
                if freed >= num_pages:
                    break
                out.append(leaf.pages)
                freed += leaf.num_pages
                self._remove(leaf)
        self.num_pages -= freed
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _evict_order(self, leaf: RadixNode) -> tuple[int, ...]:
        """Sort key of evictable leaves: the smallest goes first."""
        return (leaf.last_access,)

    def _remove(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[self._key(leaf.tokens, 0)]
        leaf.parent = None

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def all_pages(self) -> np.ndarray:
        """Every page id the cache holds (for invariant checks)."""
        parts = [n.pages for n in self._nodes()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
