"""Local (memmove) backend: registration checks, failure injection, cancel."""

from __future__ import annotations

import numpy as np
import pytest

from kvpipe.config import FaultInjection
from kvpipe.transfer.backends import BatchState, create_backend
from kvpipe.transfer.backends.local import LocalBackend, LocalFabric


def buffers(n: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)


def pair(inject: FaultInjection | None = None):
    fabric = LocalFabric()
    tx = create_backend("local", fabric=fabric, inject=inject)
    rx = LocalBackend(fabric)
    return tx, rx


def test_copy_and_unregistered_destination_fails_then_next_succeeds():
    tx, rx = pair()
    src, dst = buffers()
    other = np.zeros(64, dtype=np.uint8)
    tx.register(src.ctypes.data, src.nbytes)
    rx.register(dst.ctypes.data, dst.nbytes)
    s0 = src.ctypes.data
    h = tx.submit(rx.address, [s0, s0 + 100], [dst.ctypes.data + 8, other.ctypes.data], [50, 10])
    assert tx.wait(h) is BatchState.FAILED and "registered" in h.error
    assert (dst[8:58] == src[:50]).all()  # the op before the bad one landed
    assert not other.any()
    h = tx.submit(rx.address, [s0], [dst.ctypes.data + 4000], [200])  # runs past the region's end
    assert h.state is BatchState.FAILED
    h = tx.submit(rx.address, [s0 + 1000], [dst.ctypes.data + 1000], [96])
    assert tx.wait(h) is BatchState.DONE and (dst[1000:1096] == src[1000:1096]).all()


def test_unknown_peer_and_unregistered_source_fail():
    tx, rx = pair()
    src, dst = buffers()
    rx.register(dst.ctypes.data, dst.nbytes)
    assert tx.submit(rx.address, [src.ctypes.data], [dst.ctypes.data], [8]).state is BatchState.FAILED
    tx.register(src.ctypes.data, src.nbytes)
    assert tx.submit("local:999", [src.ctypes.data], [dst.ctypes.data], [8]).state is BatchState.FAILED
    rx.close()
    assert tx.submit(rx.address, [src.ctypes.data], [dst.ctypes.data], [8]).state is BatchState.FAILED
    assert not dst.any()


def test_failure_injection_is_seeded_and_writes_a_prefix():
    outcomes = []
    for _ in range(2):
        tx, rx = pair(FaultInjection(prob=0.5, seed=7))
        src, dst = buffers()
        tx.register(src.ctypes.data, src.nbytes)
        rx.register(dst.ctypes.data, dst.nbytes)
        states = []
        for _ in range(40):
            dst[:] = 0
            ops = np.arange(16, dtype=np.int64) * 64
            h = tx.submit(rx.address, src.ctypes.data + ops, dst.ctypes.data + ops, np.full(16, 64))
            states.append(h.state)
            landed = int(np.count_nonzero(dst[:1024] == src[:1024]) // 64) if h.state is BatchState.FAILED else 16
            # the landed ops are a prefix: everything after it is untouched
            assert (dst[: landed * 64] == src[: landed * 64]).all() and not dst[landed * 64 + 64 : 1024].any()
        outcomes.append(states)
    assert outcomes[0] == outcomes[1]  # same seed, same failures
    assert 5 < outcomes[0].count(BatchState.FAILED) < 35


@pytest.mark.parametrize("cap", [0, 3])
def test_failure_injection_fails_at_most_max_failures(cap):
    tx, rx = pair(FaultInjection(prob=1.0, max_failures=cap))
    src, dst = buffers()
    tx.register(src.ctypes.data, src.nbytes)
    rx.register(dst.ctypes.data, dst.nbytes)
    states = [tx.submit(rx.address, [src.ctypes.data], [dst.ctypes.data], [8]).state for _ in range(8)]
    assert states == [BatchState.FAILED] * cap + [BatchState.DONE] * (8 - cap)


def test_bad_op_arrays_rejected():
    tx, rx = pair()
    with pytest.raises(ValueError):
        tx.submit(rx.address, [1, 2], [3], [4])
    with pytest.raises(ValueError):
        tx.submit(rx.address, [1], [3], [0])
    with pytest.raises(ValueError):
        FaultInjection(prob=1.5)
