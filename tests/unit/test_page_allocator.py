import numpy as np
import pytest

from kvpipe.cache.page_allocator import OutOfPagesError, PageAllocator


def test_alloc_free_lowest_first_and_counts():
    a = PageAllocator(8)
    p = a.alloc(3)
    assert p.tolist() == [0, 1, 2] and p.dtype == np.int64
    q = a.alloc(2)
    assert q.tolist() == [3, 4]
    assert (a.num_free, a.num_used) == (3, 5)
    a.free(p)
    assert a.num_free == 6
    # freed low pages come back first, so a new request gets a contiguous run again
    assert a.alloc(3).tolist() == [0, 1, 2]


def test_exhaustion_has_no_side_effects():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPagesError):
        a.alloc(2)
    assert a.num_free == 1
    assert a.alloc(1).tolist() == [3]
    assert a.alloc(0).size == 0
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_double_free_caught():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free(p)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(p)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(np.array([3, 3]))
    with pytest.raises(ValueError):
        a.free([7])
    assert a.num_free == 4


def test_use_after_free_caught():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.check_owned(p)
    a.free(p[:1])
    with pytest.raises(RuntimeError, match="use after free"):
        a.check_owned(p)


def test_invalid_size():
    with pytest.raises(ValueError):
        PageAllocator(0)
