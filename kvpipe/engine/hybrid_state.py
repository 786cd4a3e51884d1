"""The scheduler's share of a hybrid model's prefix cache (HybridRadixCache): a match that ends at
a state snapshot, the snapshot copies each forward takes, the snapshots handed to the cache at
finish, and the request's own state slot. Bookkeeping only (engine/scheduler.py calls it; the
copies happen inside the forward, engine/state_snapshots.py picks the positions)."""

from __future__ import annotations

import numpy as np

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.cache.radix_cache import RadixNode
from kvpipe.cache.recurrent_slots import StateSlotAllocator
from kvpipe.engine.batch import ScheduledBatch
from kvpipe.engine.request import FinishReason, Req
from kvpipe.engine.state_snapshots import ReqSnapshots


def match_state(cache: HybridRadixCache, req: Req, page_size: int) -> tuple[np.ndarray, RadixNode]:
    """The longest cached prefix of req's prompt (minus its last token) that ends at a snapshot:
    its pages and node; req.snapshots plans the restore and the snapshots its forwards take."""
    m = cache.match_state(req.cache_ids(req.input_ids[:-1]))
    pages, node, ps = m.pages, m.node, page_size
    branch = m.kv_tokens if m.kv_tokens > len(pages) * ps else 0
    prompt_end = (len(req.input_ids) - 1) // ps * ps
    req.snapshots = ReqSnapshots(m.snapshot, branch, prompt_end, split=cache.split_rows, prompt_len=len(req.input_ids))
    return pages, node


def plan_state(
    cache: HybridRadixCache,
    allocator: PageAllocator,
    req: Req,
    batch: ScheduledBatch,
    row: int,
    start: int,
    n: int,
    page_size: int,
) -> None:
    """The state copies of `req`'s forward of tokens [start, start + n) (row `row` of `batch`): its
    cached prefix's state first, then the snapshots it takes (evicting old ones, and the pages
    that leaves unreachable, when no snapshot slot is free)."""
    snap = req.snapshots
    if snap is None:
        return
    assert req.state_slot is not None
    if snap.restore is not None:
        assert start == req.cached_tokens > 0, "a cached state is restored by the first forward"
        batch.state_restores.append((snap.restore, req.state_slot))
        snap.restore = None
    for pos in snap.positions(start, n, page_size):
        slot = snap.track if snap.is_tracking(pos) else None
        if slot is None:
            slot, freed = cache.alloc_snapshot(req.rid)
            allocator.free(freed)
            if slot is None:  # every snapshot is pinned: take its own shallowest chunk boundary's
                slot = snap.recycle(pos)
            if slot is None:
                continue  # none either: this one is skipped (a later miss)
            if snap.is_tracking(pos):
                snap.track = slot
        snap.plan(pos, slot)
        batch.state_snapshots.append((row, pos - start, slot))


def cache_snapshots(cache: HybridRadixCache, req: Req, pages: np.ndarray) -> np.ndarray:
    """At finish: req's pages up to its deepest snapshot and the snapshots go to the cache (none
    after an abort); returns the pages that stay the request's own."""
    snap, req.snapshots = req.snapshots, None
    if snap is None:
        return pages
    keep, free = snap.release(keep=req.finish_reason is not FinishReason.ABORT)
    for slot in free:
        cache.snapshots.free(slot)
    shared = req.num_shared_pages
    dup, n = cache.insert_state(req.cache_ids(req.all_ids), pages, keep)
    # pages[:shared] were the cache's all along, [shared, dup) duplicate pages it got meanwhile,
    # [shared, n) are its own now; the rest were never cached (no snapshot past them)
    return np.concatenate([pages[shared : max(dup, shared)], pages[max(n, shared) :]])


def free_state_slot(slots: StateSlotAllocator | None, req: Req) -> None:
    """Give back the recurrent-state slot `req` held from admission (hybrid models)."""
    if req.state_slot is not None:
        assert slots is not None
        slots.free(req.state_slot)
        req.state_slot = None


def state_stats(slots: StateSlotAllocator | None, cache: object) -> dict[str, int]:
    """The scheduler's stats of state slots and snapshots (empty for other models)."""
    out: dict[str, int] = {}
    if slots is not None:
        out |= {"free_state_slots": slots.num_free, "total_state_slots": slots.num_slots}
    if isinstance(cache, HybridRadixCache):
        out |= {"cached_state_snapshots": cache.num_snapshots, "free_snapshot_slots": cache.snapshots.num_free}
    return out
