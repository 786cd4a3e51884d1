"""Ring allocator over a staging pool: contiguous slots handed out in order, freed in any order.

Plain bookkeeping (no tensors, no I/O) for the decode's staging agent and the prefill's staging
buffer (buffers.py). Slots are carved at the head; the tail (the watermark) is the start of the
oldest slot still live, and moves only when that slot is freed, so a writer is never handed bytes
a slot not yet scattered still owns. A slot that does not fit before the end of the pool wraps to
offset 0 (the bytes at the end stay unused for that round, like SGLang's ring); each wrap starts a
new round, so (round, offset) orders every position the ring ever handed out.

    ring = RingAllocator(capacity=64 << 20)
    slot = ring.alloc(nbytes)      # None when the ring is full now: wait for a free and retry
    ring.free(slot.slot_id)        # -> the watermark (round, offset) after the free
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

ALIGN = 256  # bytes: slot offsets stay aligned for any dtype and for DMA engines


class OversizedError(ValueError):
    """A slot larger than the whole ring: it can never be granted."""


@dataclass(frozen=True)
class Slot:
    slot_id: int
    offset: int  # bytes from the pool's base
    nbytes: int  # as asked (the ring reserves it rounded up to ALIGN)
    round: int  # how many times the head had wrapped when this slot was carved


@dataclass
class _Live:
    slot: Slot
    end: int  # offset + aligned size
    freed: bool = False


class RingAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN:
            raise ValueError(f"a staging ring needs at least {ALIGN} bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self._live: collections.deque[_Live] = collections.deque()  # allocation order
        self._by_id: dict[int, _Live] = {}
        self._head = 0
        self._round = 0
        self._next_id = 0

    @property
    def num_live(self) -> int:
        """Slots handed out and not yet reclaimed (freed ones behind a live one count)."""
        return len(self._live)

    @property
    def used_bytes(self) -> int:
        """Bytes no writer may be handed now: from the watermark to the head."""
        if not self._live:
            return 0
        tail = self._live[0].slot.offset
        return self._head - tail if self._head > tail else self.capacity - tail + self._head

    @property
    def watermark(self) -> tuple[int, int]:
        """(round, offset) of the oldest live slot, or of the head when the ring is empty."""
        if self._live:
            return self._live[0].slot.round, self._live[0].slot.offset
        return self._round, self._head

    def alloc(self, nbytes: int) -> Slot | None:
        """A slot of `nbytes` contiguous bytes, or None while the ring is too full.
        Raises OversizedError when it can never fit."""
        if nbytes <= 0:
            raise ValueError(f"a staging slot needs a positive size, got {nbytes}")
        size = -(-nbytes // ALIGN) * ALIGN
        if size > self.capacity:
            raise OversizedError(
                f"a staging chunk of {nbytes} bytes is larger than the {self.capacity}-byte staging ring"
            )
        wrap = False
        if not self._live:  # empty: restart at the base, the whole ring is free
            if self._head:
                wrap = True
            offset = 0
        else:
            tail = self._live[0].slot.offset
            if self._head > tail:  # live bytes [tail, head): free are [head, cap) and [0, tail)
                if self.capacity - self._head >= size:
                    offset = self._head
                elif tail >= size:
                    offset, wrap = 0, True
                else:
                    return None
            elif self._head < tail and tail - self._head >= size:  # wrapped: free is [head, tail)
                offset = self._head
            else:  # head == tail with live slots: full
                return None
        if wrap:
            self._round += 1
        slot = Slot(self._next_id, offset, nbytes, self._round)
        self._next_id += 1
        live = _Live(slot, offset + size)
        self._live.append(live)
        self._by_id[slot.slot_id] = live
        self._head = live.end
        return slot

    def free(self, slot_id: int) -> tuple[int, int]:
        """Give a slot back; reclaims every freed slot at the tail. Returns the new watermark.
        Raises KeyError for a slot that is not live (unknown or freed already)."""
        live = self._by_id.pop(slot_id)
        live.freed = True
        while self._live and self._live[0].freed:
            self._live.popleft()
        return self.watermark
