"""The STANDALONE drafter's bookkeeping, apart from any tensor: which tokens the draft model's KV
holds for each request, and the draft pool's pages that hold them.

The draft model keeps its own paged KV (its own pool and PageAllocator, the target's page size).
Per request it records the tokens its KV was written for, in position order: the request's tokens
it caught up on, then the chain drafts it fed back. At the next step the valid draft KV is the
longest common prefix of those tokens and the request's tokens now (the accepted drafts match,
a rejected draft and everything after it do not), so rollback is nothing but that comparison:
the positions past it are overwritten by the next forward. The request's first decode step finds
nothing recorded and catches up on its whole prompt (the draft's prefill).

In PD (disagg/draft_transfer.py) both sides `reserve` the pages of a request's whole prompt up
front: the prefill writes the prompt's draft KV chunk by chunk (`wrote`) and sends it, the decode
records it as written once it landed (`wrote` the prompt's tokens), so its first step catches up on
the first sampled token only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpipe.cache.page_allocator import PageAllocator


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class DraftSeq:
    """One request's draft KV: `tokens[i]` is the token whose KV sits at position i of `pages`."""

    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class DraftPlan:
    """One request's draft forwards this step: an extend of `catch_up` (the request's tokens past
    the valid draft KV, ending with its last token) at position `start`, then chain forwards of
    single drafts; `pages` covers every position they write."""

    start: int
    catch_up: list[int]
    pages: np.ndarray


class DraftBook:
    """Per-request draft KV bookkeeping over the draft pool's allocator."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.seqs: dict[str, DraftSeq] = {}

    @staticmethod
    def valid_len(recorded: Sequence[int], tokens: Sequence[int]) -> int:
        """Positions of draft KV still valid for a request whose tokens are now `tokens`: the
        common prefix, never the last token (its logits propose the first draft)."""
        n = min(len(recorded), len(tokens) - 1)
        if n <= 0:
            return 0
        a = np.asarray(recorded[:n], dtype=np.int64)
        b = np.asarray(tokens[:n], dtype=np.int64)
        diff = np.flatnonzero(a != b)
        return int(diff[0]) if diff.size else n

    def plan(self, rid: str, tokens: Sequence[int], num_drafts: int, max_start: int | None = None) -> DraftPlan | None:
        """The forwards that propose `num_drafts` drafts for request `rid` (tokens so far:
        `tokens`), with its pages allocated; None when the draft pool has no room for them (the
        request then gets no drafts this step, and its draft KV stays as it was). `max_start`: the
        catch-up starts there at the latest (a hybrid draft's state has seen no more tokens)."""
        if num_drafts <= 0 or not tokens:
            return None
        seq = self.seqs.setdefault(rid, DraftSeq())
        start = self.valid_len(seq.tokens, tokens)
        if max_start is not None:
            start = min(start, max_start)
        # the catch-up writes positions [start, len), the chain feeds drafts 1 .. k-1 back
        end = len(tokens) + num_drafts - 1
        need = _cdiv(end, self.page_size) - len(seq.pages)
        if need > self.allocator.num_free:
            return None
        if need > 0:
            seq.pages = np.concatenate([seq.pages, self.allocator.alloc(need)])
        del seq.tokens[start:]
        return DraftPlan(start, [int(t) for t in tokens[start:]], seq.pages[: _cdiv(end, self.page_size)])

    def reserve(self, rid: str, num_pages: int) -> np.ndarray:
        """PD: the request's first `num_pages` draft pages (a whole prompt's), allocated now if it
        holds fewer; empty when the pool has no room for them (nothing is allocated then)."""
        seq = self.seqs.setdefault(rid, DraftSeq())
        need = num_pages - len(seq.pages)
        if need > self.allocator.num_free:
            return np.zeros(0, dtype=np.int64)
        if need > 0:
            seq.pages = np.concatenate([seq.pages, self.allocator.alloc(need)])
        return seq.pages[:num_pages]

    def wrote(self, rid: str, tokens: Sequence[int]) -> None:
        """The draft model wrote KV for `tokens` after the ones recorded (catch-up, then drafts)."""
        self.seqs[rid].tokens.extend(int(t) for t in tokens)

    def release(self, rid: str) -> None:
        """The request ended (finished, aborted, failed): its draft pages go back (idempotent)."""
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.allocator.free(seq.pages)

    @property
    def num_used_pages(self) -> int:
        return sum(len(s.pages) for s in self.seqs.values())
