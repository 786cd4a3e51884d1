"""Op splitting into transport-sized pieces (pure numpy): bytes, addresses and order are kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.transfer.planning.op_pieces import piece_counts, split_ops


def reference(src, dst, length, max_bytes):
    """The obvious loop, for comparison."""
    out = []
    for s, d, n in zip(src, dst, length):
        for off in range(0, n, max_bytes):
            out.append((s + off, d + off, min(max_bytes, n - off)))
    return out


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), max_size=30), max_bytes=st.integers(1, 1200), seed=st.integers(0, 2**16))
def test_pieces_cover_each_op_contiguously(lengths, max_bytes, seed):
    rng = np.random.default_rng(seed)
    n = np.asarray(lengths, dtype=np.int64)
    src = rng.integers(1, 1 << 40, n.size)
    dst = rng.integers(1, 1 << 40, n.size)
    ps, pd, pn = split_ops(src, dst, n, max_bytes)
    assert ps.dtype == pd.dtype == pn.dtype == np.int64
    assert list(zip(ps.tolist(), pd.tolist(), pn.tolist())) == reference(src.tolist(), dst.tolist(), lengths, max_bytes)
    assert pn.sum() == n.sum() and (pn <= max_bytes).all() and (pn > 0).all()
    assert pn.size == piece_counts(n, max_bytes).sum()
    # within an op, each piece starts where the previous one ended, on both sides
    op = np.repeat(np.arange(n.size), piece_counts(n, max_bytes))
    same = op[1:] == op[:-1]
    assert (ps[1:][same] == (ps + pn)[:-1][same]).all() and (pd[1:][same] == (pd + pn)[:-1][same]).all()


def test_short_ops_come_back_unchanged():
    s, d, n = np.array([10, 20]), np.array([30, 40]), np.array([4, 8])
    ps, pd, pn = split_ops(s, d, n, 8)
    assert all(np.shares_memory(a, b) for a, b in ((ps, s), (pd, d), (pn, n)))  # no copy on the common path


def test_odd_lengths_and_exact_multiples():
    ps, pd, pn = split_ops([100, 1000], [500, 9000], [7, 8], 4)
    assert ps.tolist() == [100, 104, 1000, 1004]
    assert pd.tolist() == [500, 504, 9000, 9004]
    assert pn.tolist() == [4, 3, 4, 4]


def test_zero_length_ops_vanish_and_empty_input():
    ps, pd, pn = split_ops([1, 2, 3], [4, 5, 6], [0, 9, 0], 4)
    assert (ps.tolist(), pd.tolist(), pn.tolist()) == ([2, 6, 10], [5, 9, 13], [4, 4, 1])
    ps, pd, pn = split_ops([], [], [], 4)
    assert ps.size == pd.size == pn.size == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        split_ops([1], [1], [5], 0)
    with pytest.raises(ValueError, match="differ"):
        split_ops([1, 2], [1], [5], 4)
    with pytest.raises(ValueError, match="negative"):
        split_ops([1], [1], [-5], 4)
