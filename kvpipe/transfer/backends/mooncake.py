"""Mooncake Transfer Engine backend: non-blocking one-sided writes with a bounded window.

Facts this is built on (docs/architecture.md, Transfer engine facts; checked against
mooncake-transfer-engine 0.3.13):
- `transfer_submit_write` queues one op and returns a batch id (0 or -1 on failure);
  `transfer_check_status(id)` returns 1 done, 0 pending, -1 failed (both free the id), -2 timed out.
  The blocking calls busy-spin a core, so we poll with a short sleep instead.
- More than ~2,048 ops in flight to one peer get "queue-full" rejections, after which the peer's
  remaining ops never finish and new ones fail until the engine is recreated. So: at most
  `window` pieces in flight per peer, and at most a couple of seconds of its measured rate in
  bytes (peer_link.py: admission holds the rest in our queue); a failed op fails its batch, which
  stops issuing ops and drains the ones in flight.
- Slow is not stuck (issue 50): progress is judged per peer, from pieces that complete, with
  pieces sized to a fraction of a second of that peer's link. A peer is stuck when none of its
  pieces completed for `stall_timeout_s` (`drain_timeout_s` while a failed batch drains): the engine
  is then recreated, which re-registers local memory and gives the backend a new `address` (port):
  only a sender ever needs it, and peers of a receiver never see its address change otherwise.
  Only what cannot complete fails then (batches with pieces on the wire to the stuck peer, failed
  batches); every other batch is issued again on the new engine (`resent`). A link that stops for
  less than `stall_timeout_s` (a partition that heals) resumes on the same connections: TCP
  retransmits what was in flight once packets pass again.
- A peer declared dead (heartbeats) that speaks again is `relink`ed: if pieces to it are still on the
  wire, the engine is recreated as above (the TCP transport keeps its lanes to a peer open and has
  no call that closes them), so the writes after the outage do not queue behind lanes whose
  retransmission timer doubled through it. Lanes with nothing on the wire are not backed off (an
  acknowledgement resets the timer) and stay. Usually the stall check above recreated the engine
  already, while the peer was away (its rooms failed, their batches drained past drain_timeout_s);
  this covers a peer that returns before that. Only after a fault: nothing else calls it.
- A write outside the peer's registered memory fails with -1 and the engine stays usable.
- One op rides one lane (connection) of the TCP transport, 4 lanes per peer by default
  (MC_TCP_LANES_PER_PEER): a batch of fewer long ops than lanes leaves lanes idle, and the last
  long op of a batch finishes alone. `submit` splits ops longer than `max_op_bytes` into pieces
  (planning/op_pieces.py) and the window counts pieces; a batch is DONE when all its pieces landed and
  FAILED when any failed, and injected failures cut it after a random prefix of pieces. Handles
  count planned ops in `num_ops` (what senders budget) and wire ops in `num_pieces`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

import numpy as np

from kvpipe.config import FaultInjection
from kvpipe.transfer.backends.base import (
    BackendOptions,
    BatchHandle,
    BatchState,
    TransferBackend,
    TransferError,
    _Injector,
    as_op_arrays,
)
from kvpipe.transfer.backends.mooncake_log import quiet_start
from kvpipe.transfer.backends.peer_link import PeerLink
from kvpipe.transfer.planning.op_pieces import split_ops

log = logging.getLogger(__name__)

_BAD_BATCH_IDS = (0, -1, (1 << 64) - 1)  # how a failed submit comes back through pybind
FULL_SCAN_S = 0.01
# Longest op put on the wire. Loopback, 2 cores (docs/benchmarks.md): raw pieces of 2-8 MiB are the
# plateau of `kvpipe bench transfer --raw-sweep`, <= 256 KiB pay the per-op cost; kvpipe split at
# 4 MiB is level with or slightly ahead of unsplit 16 MiB ops, at 1 MiB it is 1-5% behind.
DEFAULT_MAX_OP_BYTES = 4 << 20


class _Batch:
    """A batch's pieces (wire ops) and how far they got."""

    def __init__(self, handle: BatchHandle, s: np.ndarray, d: np.ndarray, n: np.ndarray, fail_at: int | None):
        self.handle = handle
        self.src, self.dst, self.len = s.tolist(), d.tolist(), n.tolist()
        # pieces still to issue, in order (an injected failure: only the first fail_at of them)
        self.todo = collections.deque(range(len(self.len) if fail_at is None else fail_at))
        self.injected, self.fail_at = fail_at is not None, fail_at
        self.inflight: list[tuple[int, int]] = []  # (engine batch id, piece index)
        self.failure: str | None = None  # set once: stop issuing, drain, then FAILED
        self.last_full_scan = 0.0

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.todo.clear()

    def restart(self) -> None:
        """The engine holding our pieces in flight was thrown away: issue them again (a write of the
        same bytes to the same place; the source still holds them while the batch is pending)."""
        self.todo = collections.deque(sorted(i for _, i in self.inflight) + list(self.todo))
        self.inflight = []


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        *,
        window: int = 256,
        max_op_bytes: int | None = DEFAULT_MAX_OP_BYTES,
        drain_timeout_s: float = 2.0,
        stall_timeout_s: float = 30.0,
        inject: FaultInjection | None = None,
    ) -> None:
        if not 0 < window <= 1024:
            raise ValueError(f"window must be in (0, 1024] ops per peer, got {window}")
        if max_op_bytes is not None and max_op_bytes <= 0:
            raise ValueError(f"max_op_bytes must be positive (or None: never split), got {max_op_bytes}")
        self.hostname, self.protocol, self.device = hostname, protocol, device
        self.window = window  # pieces in flight per peer
        self.max_op_bytes = max_op_bytes  # longer ops go out as pieces of this size; None: as submitted
        self.drain_timeout_s = drain_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.generation = 0  # bumped on every engine recreation
        self._injector = _Injector(inject)
        self._regions: dict[int, int] = {}  # addr -> nbytes, re-registered on recreation
        self._queues: dict[str, collections.deque[_Batch]] = {}
        self._links: dict[str, PeerLink] = {}  # per peer: what is in flight, how fast it completes
        self.resent = 0  # batches issued again on a recreated engine
        self.recreated: list[str] = []  # why each recreation happened
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._engine = self._new_engine()

    @classmethod
    def from_options(cls, options: BackendOptions) -> MooncakeBackend:
        """TCP, or RDMA on `options.ib_device`."""
        device = options.ib_device or ""
        return cls(options.host, "rdma" if device else "tcp", device, inject=options.inject)

    def sibling(self, inject: FaultInjection | None = None) -> MooncakeBackend:
        return MooncakeBackend(
            self.hostname,
            self.protocol,
            self.device,
            window=self.window,
            max_op_bytes=self.max_op_bytes,
            drain_timeout_s=self.drain_timeout_s,
            stall_timeout_s=self.stall_timeout_s,
            inject=inject,
        )

    def _new_engine(self):
        from mooncake.engine import TransferEngine  # lazy: optional dependency

        with quiet_start():
            engine = TransferEngine()
            rc = engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, self.device)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({self.hostname!r}, P2PHANDSHAKE, {self.protocol!r}, "
                f"{self.device!r}) returned {rc}"
            )
        if self._regions:
            addrs = list(self._regions)
            rc = engine.batch_register_memory(addrs, [self._regions[a] for a in addrs])
            if rc != 0:
                raise TransferError(f"re-registering {len(addrs)} buffers returned {rc}")
        self._address = f"{self.hostname}:{engine.get_rpc_port()}"
        return engine

    @property
    def address(self) -> str:
        return self._address

    @property
    def engine(self):
        """The live TransferEngine (None once closed), for benchmarks that drive it raw."""
        return self._engine

    def register(self, addr: int, nbytes: int) -> None:
        self.register_many([addr], [nbytes])

    def register_many(self, addrs: list[int], sizes: list[int]) -> None:
        if len(addrs) != len(sizes) or any(a <= 0 or n <= 0 for a, n in zip(addrs, sizes)):
            raise TransferError(f"bad registration: addrs {addrs}, sizes {sizes}")
        with self._lock:
            rc = self._engine.batch_register_memory(list(addrs), list(sizes))
            if rc != 0:
                raise TransferError(f"Mooncake batch_register_memory of {len(addrs)} buffers returned {rc}")
            self._regions.update(zip(addrs, sizes))

    def unregister(self, addr: int) -> None:
        with self._lock:
            if self._regions.pop(addr, None) is None:
                raise TransferError(f"address {addr:#x} was not registered")
            self._engine.unregister_memory(addr)

    def submit(self, peer: str, src_addrs, dst_addrs, lengths) -> BatchHandle:
        s, d, n = as_op_arrays(src_addrs, dst_addrs, lengths)
        with self._lock:
            if self._engine is None:
                raise TransferError("backend is closed")
            link = self._links.setdefault(peer, PeerLink())
            if self.max_op_bytes is None:
                ps, pd, pn = s, d, n
            else:  # pieces of a fraction of a second of this peer's link (peer_link.py)
                ps, pd, pn = split_ops(s, d, n, link.piece_bytes(self.max_op_bytes))
            handle = BatchHandle(next(self._ids), peer, int(n.size), int(n.sum()), int(pn.size))
            batch = _Batch(handle, ps, pd, pn, self._injector.ops_before_failure(int(pn.size)))
            self._queues.setdefault(peer, collections.deque()).append(batch)
            self._progress()
        return handle

    def poll(self, handle: BatchHandle) -> BatchState:
        if handle.state is BatchState.PENDING:
            with self._lock:
                self._progress()
        return handle.state

    def cancel(self, handle: BatchHandle, reason: str = "cancelled") -> None:
        with self._lock:
            for batch in self._queues.get(handle.peer, ()):
                if batch.handle is handle:
                    batch.fail(reason)
            self._progress()

    def last_progress(self, peer: str) -> float | None:
        with self._lock:
            link = self._links.get(peer)
            return None if link is None else link.last_progress

    def _progress(self) -> None:
        """Reap finished pieces, issue new ones within each peer's window and budget, finish
        batches, recreate the engine if a peer is stuck. Never blocks."""
        now, stuck = time.monotonic(), {}
        for peer, queue in list(self._queues.items()):
            link = self._links[peer]
            for b in queue:
                self._reap(peer, b, link, now)
            self._issue(peer, queue, link, now)
            # Stuck: no piece to this peer completed for the stall timeout while pieces are in flight
            # (per peer, not per batch: a batch queued behind others on a full link is not stuck); a
            # failed batch's pieces get drain_timeout_s (after a queue-full rejection the rest never finish)
            timeout = self.drain_timeout_s if any(b.failure and b.inflight for b in queue) else self.stall_timeout_s
            if link.stalled_for(now) > timeout:
                stuck[peer] = f"writes to {peer} made no progress for {link.stalled_for(now):.1f}s ({link.describe()})"
            for b in [b for b in queue if not b.inflight and (b.failure or not b.todo)]:
                queue.remove(b)
                b.handle._finish(BatchState.FAILED if b.failure else BatchState.DONE, b.failure)
            if not queue:
                del self._queues[peer]
        if stuck:
            self._recreate(stuck)

    def _reap(self, peer: str, b: _Batch, link: PeerLink, now: float) -> None:
        # Pieces mostly finish in order: check from the oldest and stop at the first pending one (a
        # full scan costs ~1 us per piece per poll); every FULL_SCAN_S look at all of them, so a
        # failure or completion behind a slow piece is not missed for long.
        full = now - b.last_full_scan >= FULL_SCAN_S
        if full:
            b.last_full_scan = now
        still = []
        for j, (bid, i) in enumerate(b.inflight):
            rc = self._engine.transfer_check_status(bid)
            if rc == 0:
                still.append((bid, i))
                if not full:
                    still.extend(b.inflight[j + 1 :])
                    break
                continue
            link.ended(b.len[i], now, ok=rc > 0)
            if rc < 0:
                b.fail(f"transfer to {peer} failed (status {rc})")
        b.inflight = still

    def _issue(self, peer: str, queue: collections.deque[_Batch], link: PeerLink, now: float) -> None:
        """FIFO: earlier batches get the window (pieces) and the budget (bytes) first; what does not
        fit waits here, not in the engine."""
        for b in queue:
            while b.todo:
                i = b.todo[0]
                if link.inflight_pieces >= self.window or not link.may_issue(b.len[i]):
                    return
                bid = self._engine.transfer_submit_write(peer, b.src[i], b.dst[i], b.len[i])
                if bid in _BAD_BATCH_IDS:
                    b.fail(f"submitting piece {i} to {peer} failed (peer unreachable?)")
                    break
                b.todo.popleft()
                b.inflight.append((bid, i))
                link.issued(b.len[i], now)
            if b.injected and b.failure is None and not b.todo:
                b.fail(f"injected failure after {b.fail_at} of {b.handle.num_pieces} pieces")

    def relink(self, peer: str) -> bool:
        with self._lock:
            link = self._links.get(peer)
            if self._engine is None or link is None or link.inflight_pieces == 0:
                return False  # nothing on the wire to it: its lanes are not backed off
            self._recreate({peer: f"{peer} was declared dead and spoke again: new connections to it"})
            return True

    def _recreate(self, stuck: dict[str, str]) -> None:
        """Throw the engine away (the stuck pieces die with it) and start a fresh one. What cannot
        complete fails: batches with pieces on the wire to a stuck peer, and failed batches. Every
        other batch (other peers', and a stuck peer's that had nothing on the wire) is issued again
        on the new engine: its pieces in flight there are written again."""
        for peer, queue in self._queues.items():
            why = stuck.get(peer)
            for b in list(queue):
                if b.failure or (why is not None and b.inflight):
                    queue.remove(b)
                    b.handle._finish(BatchState.FAILED, b.failure or f"engine recreated: {why}")
                else:
                    self.resent += bool(b.inflight)
                    b.restart()
            self._links[peer].forget_inflight()
        self._queues = {p: q for p, q in self._queues.items() if q}
        self._engine = None  # destroys the old engine and its connections
        self._engine = self._new_engine()
        self.generation += 1
        self.recreated.append("; ".join(stuck.values()))
        log.warning(
            "Mooncake engine recreated (generation %d, %d batches re-sent so far): %s",
            self.generation,
            self.resent,
            self.recreated[-1],
        )

    def close(self) -> None:
        with self._lock:
            for queue in self._queues.values():
                for b in queue:
                    b.handle._finish(BatchState.FAILED, "backend closed")
            self._queues.clear()
            self._engine = None
