"""The Mooncake backend across the testbed's link (root, iproute2, nftables): slow is not stuck, a
partition shorter than the stall timeout resumes on the same engine, and a stuck peer fails only
the batches that were on its wire while another peer's batches are re-sent on the new engine.

The sender and one receiver live on side b, another receiver on side a: every write to it crosses the
shaped veth pair. Stall timeouts are a few seconds so that the tests are short; the link rates are
chosen so that the old per-batch stall clock would have fired (a batch queued behind the others for
longer than the timeout)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpipe.harness.link_faults import FaultRun, LinkFault, nft_missing
from kvpipe.harness.testbed import LinkTestbed, can_run, inside_netns
from kvpipe.transfer.backends import BatchState
from kvpipe.transfer.backends.mooncake import MooncakeBackend

pytest.importorskip("mooncake.engine")
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not can_run(), reason="needs root and iproute2"),
    pytest.mark.skipif(nft_missing() is not None, reason=str(nft_missing())),
]

MB = 1 << 20


class Side:
    """A receiver's registered buffer (the sender's source is the same size, filled with a pattern)."""

    def __init__(self, backend: MooncakeBackend, nbytes: int) -> None:
        self.backend = backend
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        backend.register(self.buf.ctypes.data, nbytes)


def _sender(nbytes: int, stall_s: float) -> tuple[MooncakeBackend, np.ndarray]:
    tx = MooncakeBackend("10.99.0.2", window=64, stall_timeout_s=stall_s, drain_timeout_s=stall_s)
    src = (np.arange(nbytes, dtype=np.int64) % 251).astype(np.uint8)
    tx.register(src.ctypes.data, nbytes)
    return tx, src


def _submit(tx: MooncakeBackend, src: np.ndarray, rx: Side, n: int, size: int):
    """n batches of `size` bytes each, at consecutive offsets."""
    return [
        tx.submit(rx.backend.address, [src.ctypes.data + k * size], [rx.buf.ctypes.data + k * size], [size])
        for k in range(n)
    ]


def _wait(tx: MooncakeBackend, handles, seconds: float) -> list[BatchState]:
    end = time.monotonic() + seconds
    return [tx.wait(h, end, poll_interval_s=0.002) for h in handles]


def test_a_full_slow_link_is_not_stuck(tmp_path) -> None:
    """16 MB in 16 batches at 16 Mbit/s: ~8 s of link for the batches queued last, which the old
    per-batch clock (3 s here) declared stuck. Per peer, every completion is progress."""
    with LinkTestbed("16mbit", state_dir=tmp_path) as tb, inside_netns(tb.ns_b):
        far = Side(tb.call_in("a", MooncakeBackend, tb.addr_a), 16 * MB)
        tx, src = _sender(16 * MB, stall_s=3.0)
        try:
            handles = _submit(tx, src, far, 16, MB)
            assert _wait(tx, handles, 120) == [BatchState.DONE] * 16, [h.error for h in handles]
            assert tx.generation == 0 and tx.recreated == []
            assert np.array_equal(far.buf, src)
        finally:
            tx.close()
            far.backend.close()


def test_short_partition_resumes_on_the_same_engine(tmp_path) -> None:
    with LinkTestbed("50mbit", state_dir=tmp_path) as tb, inside_netns(tb.ns_b):
        far = Side(tb.call_in("a", MooncakeBackend, tb.addr_a), 24 * MB)
        tx, src = _sender(24 * MB, stall_s=20.0)
        try:
            with FaultRun(tb.spec, LinkFault.parse("partition:4s"), start_after_s=0.5) as run:
                handles = _submit(tx, src, far, 24, MB)  # ~4 s of link: the partition lands mid-way
                states = _wait(tx, handles, 120)
            assert run.applied_at is not None and run.healed_at is not None
            assert states == [BatchState.DONE] * 24, [h.error for h in handles]
            assert tx.generation == 0  # TCP retransmitted what was in flight; nothing recreated
            assert np.array_equal(far.buf, src)
        finally:
            tx.close()
            far.backend.close()


def test_stuck_peer_fails_its_wire_and_the_rest_is_resent(tmp_path) -> None:
    """A partition longer than the stall timeout: each recreation fails the batches that were on the
    partitioned wire only; the far peer's batches that waited for its budget, and the near peer's,
    go again on the new engine, and those that got through after the heal landed intact."""
    with LinkTestbed("50mbit", state_dir=tmp_path) as tb, inside_netns(tb.ns_b):
        far = Side(tb.call_in("a", MooncakeBackend, tb.addr_a), 32 * MB)
        near = Side(MooncakeBackend(tb.addr_b), 32 * MB)
        tx, src = _sender(32 * MB, stall_s=2.0)
        try:
            assert _wait(tx, _submit(tx, src, far, 1, MB), 30) == [BatchState.DONE]  # connected, rate known
            with FaultRun(tb.spec, LinkFault.parse("partition:5s")):
                time.sleep(0.3)
                lost = _submit(tx, src, far, 32, MB)  # more than the far peer's budget: some wait
                kept = _submit(tx, src, near, 32, MB)  # side b's own loopback
                states_near = _wait(tx, kept, 60)
                states_far = _wait(tx, lost, 90)
            assert tx.generation >= 1 and "made no progress" in tx.recreated[0]
            assert states_near == [BatchState.DONE] * 32, [h.error for h in kept]
            assert set(states_far) <= {BatchState.DONE, BatchState.FAILED}, states_far  # each ended
            assert np.array_equal(near.buf, src)
            failed = [h for h in lost if h.state is BatchState.FAILED]
            done = [k for k, h in enumerate(lost) if h.state is BatchState.DONE]
            assert failed and done, (tx.recreated, [h.error for h in lost])
            assert all((h.error or "").startswith("engine recreated: writes to") for h in failed)
            for k in done:
                assert np.array_equal(far.buf[k * MB : (k + 1) * MB], src[k * MB : (k + 1) * MB])
        finally:
            tx.close()
            near.backend.close()
            far.backend.close()
