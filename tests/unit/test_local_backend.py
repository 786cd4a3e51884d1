"""Local (memmove) backend beyond the interface (every backend's cases are in
test_backend_conformance.py): it checks the source side too, and an invalid op stops its batch
there, with the ops before it landed, inside `submit`."""

from __future__ import annotations

import numpy as np

from kvpipe.transfer.backends import BatchState
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric


def registered_pair() -> tuple[LocalBackend, LocalBackend, np.ndarray, np.ndarray]:
    tx = LocalBackend(LocalFabric())
    rx = tx.sibling()
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    tx.register(src.ctypes.data, src.nbytes)
    rx.register(dst.ctypes.data, dst.nbytes)
    return tx, rx, src, dst


def test_a_bad_op_stops_the_batch_after_the_ops_before_it_landed():
    tx, rx, src, dst = registered_pair()
    other = np.zeros(64, dtype=np.uint8)
    s0, d0 = src.ctypes.data, dst.ctypes.data
    h = tx.submit(rx.address, [s0, s0 + 100, s0 + 200], [d0 + 8, other.ctypes.data, d0 + 200], [50, 10, 10])
    assert h.state is BatchState.FAILED and "op 1" in h.error and "registered" in h.error  # terminal at submit
    assert (dst[8:58] == src[:50]).all()  # the op before the bad one landed
    assert not other.any() and not dst[200:210].any()  # the bad one and those after it did not


def test_an_unregistered_source_fails():
    tx, rx, src, dst = registered_pair()
    stray = np.arange(64, dtype=np.uint8)
    h = tx.submit(rx.address, [stray.ctypes.data], [dst.ctypes.data], [8])
    assert h.state is BatchState.FAILED and "source" in h.error
    assert tx.submit("local:999", [src.ctypes.data], [dst.ctypes.data], [8]).state is BatchState.FAILED
    assert not dst.any()
