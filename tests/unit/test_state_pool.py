"""State slots: the allocator's bookkeeping (no tensors) and the StatePool's buffers."""

from __future__ import annotations

import pytest
import torch

from kvpipe.cache.recurrent_pool import StatePool, StateShape
from kvpipe.cache.recurrent_slots import StateSlotAllocator


def test_alloc_lowest_first_until_exhausted():
    a = StateSlotAllocator(3)
    assert [a.alloc("r0"), a.alloc("r1"), a.alloc("r2")] == [0, 1, 2]
    assert a.alloc("r3") is None  # full: the caller waits, nothing changed
    assert (a.num_free, a.num_used) == (0, 3)
    a.free(1)
    assert a.alloc("r4") == 1 and a.owner(1) == "r4"


def test_double_free_and_out_of_range_caught():
    a = StateSlotAllocator(2)
    s = a.alloc("r")
    a.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(1)  # never allocated
    with pytest.raises(ValueError):
        a.free(2)
    with pytest.raises(ValueError):
        StateSlotAllocator(0)
    assert a.num_free == 2


def test_leaks_are_detectable_by_owner():
    a = StateSlotAllocator(4)
    a.alloc("done")
    kept = a.alloc("leaky")
    a.free(0)
    assert a.in_use() == {kept: "leaky"}
    a.free(kept)
    assert a.in_use() == {} and a.num_free == 4


def test_pool_buffers_and_infos():
    shape = StateShape(conv_dim=10, conv_len=3, heads=2, key_dim=4, value_dim=5)
    pool = StatePool((0, 2, 3), num_slots=6, shape=shape, conv_dtype=torch.bfloat16)
    assert pool.conv[1].shape == (6, 10, 3) and pool.conv[1].dtype == torch.bfloat16
    assert pool.recurrent[2].shape == (6, 2, 4, 5) and pool.recurrent[2].dtype == torch.float32
    infos = pool.buffer_infos()
    assert [(i.layer, i.kind) for i in infos] == [
        (0, "conv"),
        (0, "recurrent"),
        (2, "conv"),
        (2, "recurrent"),
        (3, "conv"),
        (3, "recurrent"),
    ]
    assert infos[0].slot_nbytes == 10 * 3 * 2 and infos[1].slot_nbytes == 2 * 4 * 5 * 4
    assert infos[3].addr == pool.recurrent[1].data_ptr() and infos[3].nbytes == 6 * infos[3].slot_nbytes
    assert pool.slot_nbytes == 3 * (60 + 160) and pool.nbytes == 6 * pool.slot_nbytes
    # one slot of one buffer is one contiguous byte range at addr + slot * slot_nbytes
    assert pool.recurrent[0][4].data_ptr() == infos[1].addr + 4 * infos[1].slot_nbytes
