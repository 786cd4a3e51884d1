"""Every registered transfer backend (kvpipe/transfer/backends/registry.py) through the same cases:
what the TransferBackend interface (base.py) promises, whatever carries the bytes.

Each backend starts as a server starts it (`open_backend` with default BackendOptions: Mooncake
over TCP on loopback) and is paired with its `sibling`. A backend whose optional dependency does
not import here is skipped with the reason. The interface has no notifications, so there is no
case for them. What one backend does beyond the interface has its own module
(test_local_backend.py, integration/test_mooncake_backend.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import ConfigError, FaultInjection
from kvpipe.transfer.backends import (
    BACKENDS,
    BackendOptions,
    BackendSpec,
    BatchHandle,
    BatchState,
    TransferBackend,
    TransferError,
    backend_names,
    open_backend,
)
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import TransferPlan, plan_pages

LAYERS, PAGES, PAGE, HEADS, HD = 2, 32, 8, 2, 16
# A backend that crosses processes listens on loopback like a server: its cases carry the
# integration marker (`-m "not integration"` leaves them out; Mooncake's engines take ~1 s to close).
SPECS = [
    pytest.param(spec, id=spec.name, marks=[pytest.mark.integration] if spec.crosses_processes else [])
    for spec in BACKENDS
]


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def open_pair(spec: BackendSpec, inject: FaultInjection | None = None) -> tuple[TransferBackend, TransferBackend]:
    """(sender, receiver) of one kind; the sender injects faults when asked."""
    why = spec.missing()
    if why is not None:
        pytest.skip(why)
    tx = open_backend(spec.name, BackendOptions(inject=inject))
    return tx, tx.sibling()


@dataclass
class Pair:
    tx: TransferBackend
    rx: TransferBackend
    src: KVPool  # random, registered with tx
    dst: KVPool  # zeros, registered with rx

    def plan(self, src_pages, dst_pages, heads: tuple[int, int] | None = None) -> TransferPlan:
        return plan_pages(src_pages, dst_pages, KVLayout.from_pool(self.src), KVLayout.from_pool(self.dst), heads=heads)

    def submit(self, plan: TransferPlan) -> BatchHandle:
        return self.tx.submit(self.rx.address, plan.src_addr, plan.dst_addr, plan.length)

    def assert_landed(self, src_pages, dst_pages) -> None:
        for layer in range(LAYERS):
            assert torch.equal(self.dst.k[layer][dst_pages], self.src.k[layer][src_pages])
            assert torch.equal(self.dst.v[layer][dst_pages], self.src.v[layer][src_pages])

    def assert_untouched(self, dst_pages) -> None:
        for layer in range(LAYERS):
            assert not self.dst.k[layer][dst_pages].any() and not self.dst.v[layer][dst_pages].any()


def registered_pool(backend: TransferBackend, seed: int | None) -> KVPool:
    pool = KVPool(LAYERS, PAGES, PAGE, HEADS, HD)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for buf in pool.k + pool.v:
            buf.copy_(torch.randn(buf.shape, generator=g))
    infos = pool.buffer_infos()
    backend.register_many([b.addr for b in infos], [b.nbytes for b in infos])
    return pool


@pytest.fixture(params=SPECS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    tx, rx = open_pair(request.param)
    try:  # the backends close before the pools they registered are freed
        yield Pair(tx, rx, registered_pool(tx, seed=1), registered_pool(rx, seed=None))
    finally:
        tx.close()
        rx.close()


def test_registry_names_each_backend_once_and_loads_it() -> None:
    assert len(set(backend_names())) == len(BACKENDS) and "mooncake" in backend_names()
    for spec in BACKENDS:
        cls = spec.load()
        assert issubclass(cls, TransferBackend) and cls.name == spec.name
        assert spec.crosses_processes or not spec.crosses_hosts  # another host is another process
        assert spec.crosses_hosts or not spec.rdma


def test_a_missing_dependency_or_a_wrong_class_is_refused_clearly() -> None:
    ghost = BackendSpec("ghost", "kvpipe.transfer.backends.local:LocalBackend", "x", False, False, False, "no_such_mod")
    assert ghost.missing() is not None and "no_such_mod" in ghost.missing()  # type: ignore[operator]
    with pytest.raises(TypeError, match="not the TransferBackend named 'ghost'"):
        ghost.load()  # the class is called "local"
    with pytest.raises(ConfigError, match="unknown transfer backend 'ghost'; known: mooncake, local"):
        open_backend("ghost", BackendOptions())
    mooncake = next(s for s in BACKENDS if s.name == "mooncake")
    assert mooncake.missing() is None  # installed here: its conformance cases run, not skip


def test_pages_land_at_the_right_bytes(pair: Pair) -> None:
    src_pages, dst_pages = [2, 3, 4, 10, 11, 20], [0, 1, 2, 3, 9, 30]
    plan = pair.plan(src_pages, dst_pages)
    assert plan.num_ops == LAYERS * 2 * 4  # runs (2,3,4)->(0,1,2), 10->3, 11->9, 20->30
    h = pair.submit(plan)
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    assert (h.num_ops, h.nbytes, h.peer) == (plan.num_ops, plan.nbytes, pair.rx.address)
    assert h.num_pieces >= h.num_ops and h.finished_at is not None and h.error is None
    pair.assert_landed(src_pages, dst_pages)
    pair.assert_untouched(np.setdiff1d(np.arange(PAGES), dst_pages))
    assert pair.tx.poll(h) is BatchState.DONE  # terminal states never change


def test_many_batches_in_flight_all_land(pair: Pair) -> None:
    """3,072 single-head ops submitted before any poll: a backend holds back what its window
    cannot take (Mooncake's engine breaks past ~2,048 queued per peer) rather than fail it."""
    pages = np.arange(PAGES)
    plans = [pair.plan(pages, pages[::-1].copy(), heads=(h0, h0 + 1)) for h0 in range(HEADS)] * 12
    handles = [pair.submit(p) for p in plans]
    assert sum(h.num_ops for h in handles) == 3072
    for h in handles:
        assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    pair.assert_landed(pages, pages[::-1].copy())


def test_a_write_outside_registered_memory_fails_and_the_backend_stays_usable(pair: Pair) -> None:
    region = np.zeros(4096 + 256, dtype=np.uint8)  # the receiver registers only its first 4,096 bytes
    stray = np.zeros(4096, dtype=np.uint8)  # never registered
    pair.rx.register(region.ctypes.data, 4096)
    base = pair.src.buffer_infos()[0].addr
    for dst, n in ((stray.ctypes.data, 1024), (region.ctypes.data + 4000, 200)):  # outside; running past the end
        h = pair.tx.submit(pair.rx.address, [base], [dst], [n])
        assert pair.tx.wait(h, deadline()) is BatchState.FAILED and h.error
    assert not stray.any() and not region[4096:].any()
    plan = pair.plan([0, 1], [5, 6])
    h = pair.submit(plan)
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    pair.assert_landed([0, 1], [5, 6])


def test_unregistered_memory_takes_no_more_writes(pair: Pair) -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    pair.rx.register(buf.ctypes.data, buf.nbytes)
    pair.rx.unregister(buf.ctypes.data)
    with pytest.raises(TransferError):
        pair.rx.unregister(buf.ctypes.data)  # not registered (any more)
    base = pair.src.buffer_infos()[0].addr
    h = pair.tx.submit(pair.rx.address, [base], [buf.ctypes.data], [512])
    assert pair.tx.wait(h, deadline()) is BatchState.FAILED and not buf.any()
    pair.rx.register(buf.ctypes.data, buf.nbytes)
    h = pair.tx.submit(pair.rx.address, [base], [buf.ctypes.data], [512])
    assert pair.tx.wait(h, deadline()) is BatchState.DONE
    assert buf[:512].tobytes() == pair.src.k[0].numpy().tobytes()[:512]


def test_an_unreachable_peer_fails_the_batch(pair: Pair) -> None:
    gone = pair.rx.sibling()
    address = gone.address
    gone.close()
    plan = pair.plan([0], [0])
    h = pair.tx.submit(address, plan.src_addr, plan.dst_addr, plan.length)
    assert pair.tx.wait(h, deadline()) is BatchState.FAILED and h.error
    h = pair.submit(plan)  # other peers are not affected
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error


def test_cancel_fails_a_pending_batch_and_leaves_a_finished_one(pair: Pair) -> None:
    pages = np.arange(PAGES)
    plan = pair.plan(pages, pages, heads=(0, 1))  # 128 ops: more than one poll's worth on a windowed backend
    big = [pair.submit(plan) for _ in range(8)]
    was = [h.state for h in big]
    for h in big:
        pair.tx.cancel(h, "client went away")
    for h, before in zip(big, was, strict=True):
        after = pair.tx.wait(h, deadline())
        if before is BatchState.PENDING:
            assert after is BatchState.FAILED and h.error == "client went away"
        else:
            assert after is before  # a finished batch keeps its outcome
    plan = pair.plan([3], [4])
    h = pair.submit(plan)
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    pair.assert_landed([3], [4])


def test_bad_op_arrays_are_refused(pair: Pair) -> None:
    with pytest.raises(ValueError):
        pair.tx.submit(pair.rx.address, [1, 2], [3], [4])
    with pytest.raises(ValueError):
        pair.tx.submit(pair.rx.address, [1], [3], [0])
    h = pair.submit(pair.plan([1], [1]))
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error


def test_close_and_recreate(pair: Pair) -> None:
    """A closed backend refuses submits; a new one on the same memory serves at its own address."""
    plan = pair.plan([0, 1], [2, 3])
    pair.tx.close()
    pair.tx.close()  # twice is fine
    with pytest.raises(TransferError):
        pair.submit(plan)
    tx = pair.rx.sibling()
    try:
        infos = pair.src.buffer_infos()
        tx.register_many([b.addr for b in infos], [b.nbytes for b in infos])
        old = pair.rx.address
        pair.rx.close()
        rx = tx.sibling()
        try:
            infos = pair.dst.buffer_infos()
            rx.register_many([b.addr for b in infos], [b.nbytes for b in infos])
            h = tx.submit(old, plan.src_addr, plan.dst_addr, plan.length)
            assert tx.wait(h, deadline()) is BatchState.FAILED
            pair.assert_untouched([2, 3])
            h = tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)
            assert tx.wait(h, deadline()) is BatchState.DONE, h.error
            pair.assert_landed([0, 1], [2, 3])
        finally:
            rx.close()
    finally:
        tx.close()


def run_injected(spec: BackendSpec, inject: FaultInjection, batches: int) -> list[BatchState]:
    """`batches` batches of 16 ops of 64 bytes through a sender that injects failures; checks that
    a failed batch landed a prefix of its ops and nothing after it."""
    tx, rx = open_pair(spec, inject)
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    try:
        tx.register(src.ctypes.data, src.nbytes)
        rx.register(dst.ctypes.data, dst.nbytes)
        offsets = np.arange(16, dtype=np.int64) * 64
        states = []
        for _ in range(batches):
            dst[:] = 0
            h = tx.submit(rx.address, src.ctypes.data + offsets, dst.ctypes.data + offsets, np.full(16, 64))
            states.append(tx.wait(h, deadline()))
            assert states[-1] is not BatchState.PENDING
            landed = [bool((dst[o : o + 64] == src[o : o + 64]).all()) for o in offsets]
            if states[-1] is BatchState.DONE:
                assert all(landed)
            else:
                assert "injected" in (h.error or "")
                k = landed.index(False) if False in landed else 16
                assert all(landed[:k]) and not dst[k * 64 : 1024].any()  # a prefix, then nothing
        return states
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("spec", SPECS)
def test_fault_injection_is_seeded_and_fails_after_a_prefix(spec: BackendSpec) -> None:
    runs = [run_injected(spec, FaultInjection(prob=0.5, seed=7), 24) for _ in range(2)]
    assert runs[0] == runs[1]  # same seed, same failures
    assert 3 <= runs[0].count(BatchState.FAILED) <= 21


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("cap", [0, 3])
def test_fault_injection_fails_at_most_max_failures(spec: BackendSpec, cap: int) -> None:
    states = run_injected(spec, FaultInjection(prob=1.0, max_failures=cap), 6)
    assert states == [BatchState.FAILED] * cap + [BatchState.DONE] * (6 - cap)


def test_relink_with_nothing_on_the_wire_drops_nothing_and_writes_go_on(pair: Pair) -> None:
    """A peer declared dead spoke again: with no write of ours on the wire to it, no connection of
    ours to it is backed off and `relink` keeps them (integration/test_mooncake_backend.py: with
    writes on the wire)."""
    assert pair.tx.relink(pair.rx.address) is False  # nothing written to it yet
    h = pair.submit(pair.plan([0, 1], [2, 3]))
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    assert pair.tx.relink(pair.rx.address) is False  # written, and landed
    h = pair.submit(pair.plan([4, 5], [6, 7]))
    assert pair.tx.wait(h, deadline()) is BatchState.DONE, h.error
    pair.assert_landed([0, 1, 4, 5], [2, 3, 6, 7])
