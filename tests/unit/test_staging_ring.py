"""RingAllocator: wraparound, watermark ordering, oversized chunks, a full ring and its recovery."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.transfer.staging.ring import ALIGN, OversizedError, RingAllocator


def test_slots_are_carved_in_order_and_wrap_to_the_base():
    ring = RingAllocator(4 * ALIGN)
    a, b, c = (ring.alloc(ALIGN) for _ in range(3))
    assert [s.offset for s in (a, b, c)] == [0, ALIGN, 2 * ALIGN]
    assert ring.alloc(2 * ALIGN) is None  # only one slot's worth left at the end, none at the base
    ring.free(a.slot_id)
    d = ring.alloc(ALIGN)  # fits at the end: no wrap yet
    assert (d.offset, d.round) == (3 * ALIGN, 0)
    e = ring.alloc(ALIGN)  # the end is used: wraps into a's bytes
    assert (e.offset, e.round) == (0, 1)
    assert ring.alloc(1) is None  # full: b, c, d, e live


def test_watermark_moves_only_when_the_oldest_slot_is_freed():
    ring = RingAllocator(4 * ALIGN)
    a, b, c = (ring.alloc(ALIGN) for _ in range(3))
    assert ring.watermark == (0, 0)
    assert ring.free(b.slot_id) == (0, 0)  # b is freed but a still holds the tail
    assert ring.num_live == 3
    assert ring.free(a.slot_id) == (0, 2 * ALIGN)  # a and b reclaimed together
    assert ring.num_live == 1 and ring.used_bytes == ALIGN
    ring.free(c.slot_id)
    assert ring.used_bytes == 0


def test_a_slot_bigger_than_the_ring_is_refused_with_a_clear_error():
    ring = RingAllocator(8 * ALIGN)
    with pytest.raises(OversizedError, match="larger than the"):
        ring.alloc(8 * ALIGN + 1)
    with pytest.raises(ValueError):
        ring.alloc(0)
    assert ring.alloc(8 * ALIGN) is not None  # the whole ring is fine


def test_a_full_ring_waits_and_resumes_after_frees():
    ring = RingAllocator(4 * ALIGN)
    big = ring.alloc(3 * ALIGN)
    small = ring.alloc(ALIGN)
    assert ring.alloc(2 * ALIGN) is None
    ring.free(small.slot_id)  # behind big: nothing reclaimed
    assert ring.alloc(2 * ALIGN) is None
    ring.free(big.slot_id)
    again = ring.alloc(2 * ALIGN)
    assert again is not None and again.offset == 0


def test_freeing_twice_or_an_unknown_slot_raises():
    ring = RingAllocator(4 * ALIGN)
    a = ring.alloc(10)
    ring.free(a.slot_id)
    with pytest.raises(KeyError):
        ring.free(a.slot_id)
    with pytest.raises(KeyError):
        ring.free(12345)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN), st.integers(0, 50)), max_size=80))
def test_live_slots_never_overlap_and_positions_only_move_forward(ops):
    """Random allocs and out-of-order frees: live slots stay inside the ring and disjoint, and a
    slot is refused only when no free gap of its size exists after the head in ring order."""
    ring = RingAllocator(16 * ALIGN)
    live = {}
    last = (0, 0)
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            s = ring.alloc(size)
            if s is None:
                assert ring.used_bytes > 0
                continue
            assert 0 <= s.offset and s.offset + size <= ring.capacity
            assert (s.round, s.offset) >= last  # the head only moves forward
            last = (s.round, s.offset)
            for o in live.values():
                assert s.offset + size <= o.offset or o.offset + o.nbytes <= s.offset
            live[s.slot_id] = s
        else:
            sid = sorted(live)[pick % len(live)]
            del live[sid]
            wm = ring.free(sid)
            if live:  # the watermark is the oldest live slot's start
                oldest = live[min(live)]
                assert wm == (oldest.round, oldest.offset)
    if not live:
        assert ring.used_bytes == 0
