"""State-slot allocator: pure bookkeeping over the slot ids of a StatePool, no tensors.

A hybrid model (linear-attention layers) keeps one fixed-size recurrent state per request, in
one slot of kvpipe/cache/recurrent_pool.py. A slot belongs to a request from its admission to its
end (finish, abort, or the release of held pages), like its KV pages.
"""

from __future__ import annotations

import heapq


class StateSlotAllocator:
    def __init__(self, num_slots: int, first: int = 0) -> None:
        """Slots [first, first + num_slots) of the pool: a hybrid prefix cache's snapshots take
        the slots after the running requests' (hybrid_radix_cache.py)."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.first = first
        self._free: list[int] = list(range(first, first + num_slots))  # a min-heap: low slots first
        self._owner: dict[int, str] = {}  # slot -> rid holding it (leaks name their request)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def alloc(self, owner: str) -> int | None:
        """A free slot for request `owner`, or None when every slot is taken."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._owner[slot] = owner
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. RuntimeError on a double free, ValueError on an id out of range."""
        if not self.first <= slot < self.first + self.num_slots:
            raise ValueError(f"state slot {slot} out of range [{self.first}, {self.first + self.num_slots})")
        if self._owner.pop(slot, None) is None:
            raise RuntimeError(f"double free of state slot {slot}")
        heapq.heappush(self._free, slot)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)

    def in_use(self) -> dict[int, str]:
        """slot -> owner of every allocated slot; empty when nothing leaked (all requests ended)."""
        return dict(self._owner)
