"""`TPSender`: KVSender's engine API for a prefill instance with TP > 1 (lives on rank 0).

Rank 0's own KVSender does its head slice; every call is also forwarded, in order, to each TP
child's agent (kvpipe/engine/tp_agent.py), whose KVSender does that rank's slice. A room is over
only when every rank reported it (tp_tally.py): Success when all succeeded, Failed when all are
done and one failed. The first failure aborts the room on every rank, so none keeps writing.

Why forwarding a send is safe without asking the child: rank 0 issues send() only after the
layers concerned ran on rank 0, and every layer ends in an all-reduce of the TP group, which
rank 0 cannot finish before each child contributed, i.e. after each child wrote that layer's KV.
On CUDA that holds once rank 0's `ready` event completed (the child's KV kernels precede its
all-reduce in stream order), so a gated call is forwarded only when `ready()` returns True.

Threads: a forwarder thread owns the writes to the agent channels (the engine thread never
blocks on a child); the engine thread reads the children's reports in poll(). A child whose
channel breaks (process gone) fails every room it had not reported.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import Callable, Sequence

import numpy as np

from kvpipe.engine.tp_agent import AbortRoom, AddRoom, AgentFailed, CloseAgent, RoomsDone, SendKV
from kvpipe.engine.tp_tally import RoomTally
from kvpipe.transfer.sender import KVSender
from kvpipe.transfer.sender_book import SenderStats, TransferTiming
from kvpipe.transfer.state import DuplicateRoomError, TransferState

logger = logging.getLogger(__name__)

GATE_POLL_S = 0.0005  # forwarder re-check of a CUDA event a forwarded call waits on
MAX_READS_PER_POLL = 4096  # bound on child messages handled in one poll()
Ready = Callable[[], bool] | None


class TPSender:
    def __init__(self, local: KVSender, conns: Sequence[Connection]) -> None:
        if local.tp_rank != 0 or local.tp_size != len(conns) + 1:
            raise ValueError(f"TPSender needs rank 0's sender of a TP {len(conns) + 1} instance, got rank "
                             f"{local.tp_rank} of {local.tp_size}")
        self.local = local
        self.tp_size = local.tp_size
        self._conns = dict(enumerate(conns, start=1))  # child rank -> agent channel
        self._lock = threading.Lock()  # tally, child stats, broken channels
        self._tally = RoomTally(self.tp_size)
        self._child_stats: dict[int, SenderStats] = {}
        self._broken: dict[int, str] = {}  # child rank -> why its channel broke (found by either thread)
        self._succeeded = 0
        self._failed = 0
        self._cv = threading.Condition()
        self._outbox: collections.deque[tuple[object, Ready]] = collections.deque()
        self._stop = False
        self._forwarder = threading.Thread(target=self._forward, name="kv-tp-forwarder", daemon=True)
        self._forwarder.start()

    # ---- KVSender's engine API ---------------------------------------------------------------
    @property
    def control_address(self) -> str:
        return self.local.control_address

    @property
    def instance_id(self) -> str:
        return self.local.instance_id

    def add_room(self, room: int, src_pages: np.ndarray | list[int]) -> None:
        pages = np.asarray(src_pages, dtype=np.int64).ravel().copy()
        with self._lock:  # tracked first: a poll() on another thread must not lose rank 0's report
            if room in self._tally:
                raise DuplicateRoomError(f"bootstrap_room {room} is still finishing on a TP rank of this prefill")
            failed = self._tally.add(room)  # a gone child fails it at once
        try:
            self.local.add_room(room, pages)  # raises (duplicate, bad pages) before any child sees it
        except BaseException:
            with self._lock:
                self._tally.discard(room)
            raise
        self._post(AddRoom(room, pages))
        if failed:
            self._abort_all(room)

    def send(self, room: int, token_start: int, token_end: int, layer_start: int = 0,
             layer_end: int | None = None, last: bool = False, aux: tuple[int, float] | None = None,
             src_pages: np.ndarray | list[int] | None = None, ready: Ready = None) -> bool:
        """KVSender.send on every rank (see there); raises as rank 0's sender does, before any
        child sees the call. Returns False if the room already failed."""
        try:
            ok = self.local.send(room, token_start, token_end, layer_start, layer_end, last, aux, src_pages, ready)
        except KeyError:
            with self._lock:
                if room not in self._tally:
                    raise
            return False  # rank 0 already reported the room failed; a child is still draining
        pages = None if src_pages is None else np.asarray(src_pages, dtype=np.int64).ravel().copy()
        self._post(SendKV(room, token_start, token_end, layer_start, layer_end, last, aux, pages), ready)
        with self._lock:
            return ok and self._tally.failure(room) is None

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        self.local.abort(room, reason)
        self._post(AbortRoom(room, reason))

    def poll(self) -> list[tuple[int, TransferState, str]]:
        """(room, Success | Failed, reason) of rooms every rank is done with: their pages may be
        freed now. Each once."""
        news = self._read_children()
        local = self.local.poll()
        fresh_failures: list[int] = []
        with self._lock:
            for rank, msg in news:
                self._child_stats[rank] = msg.stats
                for room, state, reason in msg.results:
                    if self._tally.report(rank, room, state, reason):
                        fresh_failures.append(room)
            for rank, why in list(self._broken.items()):  # the child's agent failed or its process is gone
                fresh_failures += self._tally.rank_gone(rank, why)
            for room, state, reason in local:
                if self._tally.report(0, room, state, reason):
                    fresh_failures.append(room)
            finished = self._tally.take_finished()
            for _, state, _ in finished:
                self._succeeded += state is TransferState.SUCCESS
                self._failed += state is TransferState.FAILED
        for room in dict.fromkeys(fresh_failures):
            self._abort_all(room)
        return finished

    def take_timings(self) -> list[TransferTiming]:
        """Rank 0's link use per room (each rank moves its own slice over its own link)."""
        return self.local.take_timings()

    def room_state(self, room: int) -> TransferState | None:
        state = self.local.room_state(room)
        with self._lock:
            if self._tally.failure(room) is not None:
                return TransferState.FAILED
            if state is None and room in self._tally:  # rank 0 is done, a child is not
                return TransferState.TRANSFERRING
        return state

    def num_active_rooms(self) -> int:
        with self._lock:
            return len(self._tally)

    @property
    def stats(self) -> SenderStats:
        """Counters summed over ranks; rooms counted per instance; link busy time and bytes are
        rank 0's (the layer-group planner models one rank's link, like its token_nbytes)."""
        local = self.local.stats
        with self._lock:
            children = list(self._child_stats.values())
            out = SenderStats(**{f.name: getattr(local, f.name) for f in fields(SenderStats)})
            out.rooms_succeeded, out.rooms_failed = self._succeeded, self._failed
        for st in children:
            for name in ("rejected_messages", "batches_submitted", "batches_failed", "ops_submitted",
                         "bytes_written"):
                setattr(out, name, getattr(out, name) + getattr(st, name))
        return out

    def close(self) -> None:
        """Close every child's sender (CloseAgent, after the calls queued before it) and rank 0's."""
        self._post(CloseAgent())
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._forwarder.join(timeout=5.0)
        self.local.close()

    # ---- internals -----------------------------------------------------------------------------
    def _abort_all(self, room: int) -> None:
        with self._lock:
            pending = self._tally.pending_ranks(room)
            why = self._tally.failure(room) or "another TP rank failed"
        if pending:
            logger.warning("room %d failed (%s); aborting it on TP ranks %s", room, why, pending)
            self.abort(room, why)

    def _post(self, msg: object, ready: Ready = None) -> None:
        with self._cv:
            if self._stop:
                return
            self._outbox.append((msg, ready))
            self._cv.notify()

    def _forward(self) -> None:
        """Forwarder thread: write queued calls to every live child, in order; a call gated on
        a CUDA event (and everything behind it) waits until the event completed."""
        while True:
            with self._cv:
                while not self._outbox and not self._stop:
                    self._cv.wait()
                if not self._outbox:
                    return
                msg, ready = self._outbox[0]
            if ready is not None and not ready():
                with self._cv:
                    self._cv.wait(GATE_POLL_S)
                continue
            with self._cv:
                self._outbox.popleft()
            for rank, conn in self._conns.items():
                if rank in self._broken:
                    continue
                try:
                    conn.send(msg)
                except (OSError, ValueError) as e:
                    with self._lock:
                        self._broken.setdefault(rank, f"TP rank {rank} is unreachable ({e}): its process exited")

    def _read_children(self) -> list[tuple[int, RoomsDone]]:
        out: list[tuple[int, RoomsDone]] = []
        for rank, conn in self._conns.items():
            if rank in self._broken:
                continue
            try:
                for _ in range(MAX_READS_PER_POLL):
                    if not conn.poll(0):
                        break
                    msg = conn.recv()
                    if isinstance(msg, AgentFailed):
                        raise RuntimeError(f"TP rank {rank}'s transfer agent failed: {msg.text.strip()[-500:]}")
                    if not isinstance(msg, RoomsDone):
                        raise RuntimeError(f"TP rank {rank} sent an unexpected {type(msg).__name__}")
                    out.append((rank, msg))
            except (EOFError, OSError, RuntimeError) as e:
                why = str(e) if isinstance(e, RuntimeError) else f"TP rank {rank} exited (its agent channel closed)"
                logger.error("%s: its rooms fail", why)
                with self._lock:
                    self._broken.setdefault(rank, why)
        return out
