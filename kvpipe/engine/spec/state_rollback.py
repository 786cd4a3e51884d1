"""Rolling back a hybrid model's recurrent state after a speculative verify step: bookkeeping of
the copies (cache/verify_states.py) that the next forward applies, no tensors.

A verify forward of a row over inputs x_0 .. x_k (its last token and k drafts) leaves the state
after x_k in the row's slot and the state after each x_j in StatePool.verify. When the engine has
kept inputs x_0 .. x_{n-1} (n - 1 accepted drafts, or fewer where a stop ended the request), the
slot must hold the state after x_{n-1}: a copy (slot, n - 1, slot), none when n == k + 1. The
hybrid prefix cache's snapshots inside the verified span are planned once n is known (the
scheduler planned only the one after x_0, which is always kept): a copy (slot, j, snapshot slot)
for each accepted position it takes.

Copies wait for the next forward (ForwardSpec.state_commits, applied on every TP rank before any
other state copy): a rollback of a request that finished meanwhile is dropped (its slot may hold a
new request's state by then, e.g. one a PD transfer wrote), a snapshot copy never is (the cache
owns that slot now, and nothing reads it before the next forward).
"""

from __future__ import annotations

from kvpipe.cache.hybrid_radix_cache import HybridRadixCache
from kvpipe.cache.page_allocator import PageAllocator
from kvpipe.engine.batch import ForwardMode, ScheduledBatch
from kvpipe.engine.hybrid_state import plan_state
from kvpipe.engine.request import Req


class StateRollback:
    def __init__(self) -> None:
        self._rollbacks: list[tuple[Req, int]] = []  # (request, j): its slot takes the state after x_j
        self._snapshots: list[tuple[int, int, int]] = []  # (slot, j, snapshot slot)

    def verified(
        self,
        req: Req,
        prefix_len: int,
        inputs: int,
        kept: int,
        cache: HybridRadixCache | None,
        allocator: PageAllocator,
        page_size: int,
    ) -> None:
        """Row `req` ran `inputs` inputs from `prefix_len` in a verify forward and kept the first
        `kept` (>= 1) of them. Call before the request finishes (its snapshots go to the cache then)."""
        if req.state_slot is None:
            return
        if not 1 <= kept <= inputs:
            raise ValueError(f"kept {kept} of {inputs} verify inputs")
        slot = req.state_slot
        if kept < inputs:
            self._rollbacks.append((req, kept - 1))
        snap = req.snapshots
        if snap is None:
            return
        snap.commit()  # the forward's own snapshot (after x_0) first: a later one may reuse its slot
        if cache is not None and kept > 1:
            # positions (prefix_len + 1, prefix_len + kept]: after inputs x_1 .. x_{kept-1}
            tmp = ScheduledBatch(ForwardMode.DECODE, [], [], [])
            plan_state(cache, allocator, req, tmp, 0, prefix_len + 1, kept - 1, page_size)
            self._snapshots.extend((slot, k, dst) for _, k, dst in tmp.state_snapshots)
            snap.commit()

    def take(self) -> list[tuple[int, int, int]]:
        """The copies for the next forward, in order (snapshots read the per-position states too,
        so every copy happens before that forward computes anything)."""
        out = [
            (r.state_slot, j, r.state_slot) for r, j in self._rollbacks if not r.finished and r.state_slot is not None
        ]
        out += self._snapshots
        self._rollbacks, self._snapshots = [], []
        return out
