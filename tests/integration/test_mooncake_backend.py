"""Mooncake backend on loopback (TCP): real engines, real KVPools, real failures. What every
backend must do (pages land, bad writes fail cleanly, cancel, injection, close and re-create) is in
tests/unit/test_backend_conformance.py; here what is Mooncake's own: the in-flight window, the
engine's queue-full breakage and recovery, long ops split into pieces, relink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from kvpipe.cache.kv_pool import KVPool
from kvpipe.config import FaultInjection
from kvpipe.transfer.backends import BatchState
from kvpipe.transfer.backends.mooncake import MooncakeBackend
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.planner import plan_pages

pytest.importorskip("mooncake.engine")

LAYERS, PAGES, PAGE, HEADS, HD = 2, 32, 8, 2, 16


def registered_pool(backend: MooncakeBackend, seed: int | None) -> KVPool:
    pool = KVPool(LAYERS, PAGES, PAGE, HEADS, HD)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for buf in pool.k + pool.v:
            buf.copy_(torch.randn(buf.shape, generator=g))
    infos = pool.buffer_infos()
    backend.register_many([b.addr for b in infos], [b.nbytes for b in infos])
    return pool


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture()
def engines():  # per test: pools die with the test, and their registrations must too
    tx, rx = MooncakeBackend(window=64), MooncakeBackend()
    yield tx, rx
    tx.close()
    rx.close()


def assert_pages_equal(src: KVPool, dst: KVPool, src_pages, dst_pages) -> None:
    for layer in range(LAYERS):
        assert torch.equal(dst.k[layer][dst_pages], src.k[layer][src_pages])
        assert torch.equal(dst.v[layer][dst_pages], src.v[layer][src_pages])


def test_window_bounds_many_small_ops(engines):
    tx, rx = engines  # 1,536 single-head ops, more than the window of 64 and the engine's queue
    src, dst = registered_pool(tx, seed=2), registered_pool(rx, seed=None)
    sl, dl = KVLayout.from_pool(src), KVLayout.from_pool(dst)
    pages = np.arange(PAGES)
    handles = [
        tx.submit(rx.address, p.src_addr, p.dst_addr, p.length)
        for h0 in range(HEADS)
        for p in [plan_pages(pages, pages[::-1], sl, dl, heads=(h0, h0 + 1))]
    ]
    handles += [
        tx.submit(rx.address, p.src_addr, p.dst_addr, p.length)
        for p in [plan_pages(pages, pages[::-1], sl, dl, heads=(0, 1))] * 10
    ]
    for h in handles:
        assert tx.wait(h, deadline()) is BatchState.DONE, h.error
    assert_pages_equal(src, dst, pages, pages[::-1].copy())
    assert tx.generation == 0


QUEUE_FULL_SCRIPT = r"""
import json, time, numpy as np
from kvpipe.transfer.backends.mooncake import MooncakeBackend
tx, rx = MooncakeBackend(window=256, drain_timeout_s=0.5), MooncakeBackend()
n, size = 1024, 4096
src, dst = np.full(n * size, 7, np.uint8), np.zeros(n * size, np.uint8)
tx.register(src.ctypes.data, src.nbytes); rx.register(dst.ctypes.data, dst.nbytes)
off = np.arange(n, dtype=np.int64) * size
out = {}
h = tx.submit(rx.address, src.ctypes.data + off, dst.ctypes.data + off, np.full(n, size))
out["first"] = tx.wait(h, time.monotonic() + 30).value
out["generation"] = tx.generation
tx.window = 8  # below the engine's queue limit of 16
dst[:] = 0
h = tx.submit(rx.address, src.ctypes.data + off, dst.ctypes.data + off, np.full(n, size))
out["second"] = tx.wait(h, time.monotonic() + 30).value
out["landed"] = bool((dst == 7).all())
print("RESULT " + json.dumps(out))
"""


def test_queue_full_fails_batch_and_engine_recovers():
    """A window above the engine's per-peer queue limit provokes real queue-full rejections."""
    env = {
        **os.environ,
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16",
        "GLOG_minloglevel": "2",
    }
    proc = subprocess.run(
        [sys.executable, "-c", QUEUE_FULL_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["first"] == "failed"
    assert out["second"] == "done" and out["landed"]


def test_long_ops_go_as_pieces_and_land():
    # 1,500-byte pieces (a page of one buffer is 1,024 bytes): pieces straddle heads and pages
    tx, rx = MooncakeBackend(window=8, max_op_bytes=1500), MooncakeBackend()
    try:
        src, dst = registered_pool(tx, seed=6), registered_pool(rx, seed=None)
        pages = np.arange(PAGES)
        plan = plan_pages(pages, pages[::-1].copy(), KVLayout.from_pool(src), KVLayout.from_pool(dst))
        plan_runs = plan_pages(pages[:20], pages[4:24], KVLayout.from_pool(src), KVLayout.from_pool(dst))
        h = tx.submit(rx.address, plan_runs.src_addr, plan_runs.dst_addr, plan_runs.length)
        assert tx.wait(h, deadline()) is BatchState.DONE, h.error
        op_bytes = 20 * PAGE * HEADS * HD * 4
        assert (h.num_ops, h.nbytes) == (plan_runs.num_ops, plan_runs.nbytes)  # planned ops
        assert h.num_pieces == plan_runs.num_ops * -(-op_bytes // 1500)  # what went on the wire
        assert_pages_equal(src, dst, pages[:20], pages[4:24])
        h = tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)  # page-sized ops: not split
        assert tx.wait(h, deadline()) is BatchState.DONE, h.error
        assert h.num_pieces == h.num_ops == plan.num_ops
        assert_pages_equal(src, dst, pages, pages[::-1].copy())
        assert tx.generation == 0
    finally:
        tx.close()
        rx.close()


def test_one_failed_piece_fails_the_batch_and_cancel_stops_pieces():
    tx, rx = MooncakeBackend(window=4, max_op_bytes=1024), MooncakeBackend()
    try:
        src, dst = registered_pool(tx, seed=7), registered_pool(rx, seed=None)
        stray = np.zeros(8192, dtype=np.uint8)  # never registered on the receiver
        base, target = src.buffer_infos()[0].addr, dst.buffer_infos()[0].addr
        h = tx.submit(rx.address, [base, base], [target, stray.ctypes.data], [16384, 8192])  # 16 + 8 pieces
        assert tx.wait(h, deadline()) is BatchState.FAILED and "failed" in h.error
        assert h.num_ops == 2 and h.num_pieces == 24
        assert not stray.any() and tx.generation == 0
        h = tx.submit(rx.address, [base], [target], [src.buffer_infos()[0].nbytes])
        tx.cancel(h, "client went away")
        assert tx.wait(h, deadline()) is BatchState.FAILED and h.error == "client went away"
    finally:
        tx.close()
        rx.close()


def test_injected_failure_counts_pieces():
    tx, rx = MooncakeBackend(window=8, max_op_bytes=512, inject=FaultInjection(prob=1.0, seed=1)), MooncakeBackend()
    try:
        src, dst = registered_pool(tx, seed=8), registered_pool(rx, seed=None)
        plan = plan_pages([0, 1], [0, 1], KVLayout.from_pool(src), KVLayout.from_pool(dst))
        h = tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)
        assert tx.wait(h, deadline()) is BatchState.FAILED
        assert h.error.startswith("injected failure after") and f"of {h.num_pieces} pieces" in h.error
        assert h.num_pieces == plan.nbytes // 512 > h.num_ops
    finally:
        tx.close()
        rx.close()


def test_relink_with_pieces_on_the_wire_recreates_the_engine_and_fails_only_those():
    # A peer declared dead spoke again while our pieces to it were on the wire (their lanes may sit in
    # TCP's back-off): a new engine; that peer's batch fails, another peer's is sent again and lands.
    tx, rx, other = MooncakeBackend(window=4, max_op_bytes=1024), MooncakeBackend(), MooncakeBackend()
    try:
        src, dst, dst2 = registered_pool(tx, seed=8), registered_pool(rx, seed=None), registered_pool(other, seed=None)
        pages = np.arange(PAGES)
        plan = plan_pages(pages, pages, KVLayout.from_pool(src), KVLayout.from_pool(dst))
        plan2 = plan_pages(pages, pages, KVLayout.from_pool(src), KVLayout.from_pool(dst2))
        assert not tx.relink(rx.address)  # never written to: nothing to drop
        g = tx.submit(other.address, plan2.src_addr, plan2.dst_addr, plan2.length)
        h = tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)
        assert tx.relink(rx.address)  # submit issued a window of pieces: on the wire until the next poll
        assert tx.generation == 1 and "spoke again" in tx.recreated[0]
        assert h.state is BatchState.FAILED and h.error.startswith("engine recreated: ")
        assert tx.wait(g, deadline()) is BatchState.DONE, g.error
        h = tx.submit(rx.address, plan.src_addr, plan.dst_addr, plan.length)  # the new engine reaches it
        assert tx.wait(h, deadline()) is BatchState.DONE, h.error
        assert_pages_equal(src, dst, pages, pages)
        assert_pages_equal(src, dst2, pages, pages)
        assert not tx.relink(rx.address) and tx.generation == 1  # all landed: nothing on the wire
    finally:
        tx.close()
        rx.close()
        other.close()
