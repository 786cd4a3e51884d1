"""Prefill side of KV transfer: one `KVSender` per prefill TP rank. Thread-safe, engine-agnostic.

    sender = KVSender(cfg, layout=KVLayout.from_pool(pool, head_start, total_kv_heads),
                      backend=backend, tp_rank=r, tp_size=tp, model_name=name, instance_id=iid)
    sender.start(bootstrap=("127.0.0.1", 8998))   # control endpoint + worker, registers the rank
    sender.add_room(room, src_pages)              # request admitted; src_pages: its page table
    sender.send(room, t0, t1, layer_start, layer_end)          # KV of tokens < t1 ready (chunk,
    sender.send(room, t0, n, last=True, aux=(token_id, logprob))  # layer group); final call
    for room, state, reason in sender.poll(): ...  # Success or Failed: free the room's pages now
    sender.abort(room, "client went away")        # the room turns Failed; poll reports it later
    sender.close()

The caller registers the pool's buffers with `backend` beforehand. `instance_id` must be shared
by all ranks of one prefill instance and change on every restart.

What happens inside: a receive thread (control.py) handles RegisterPeer (a decode rank's layout
and addresses, validated once per session), TransferRequest (room -> dst pages, prefix_len;
validated; stored until add_room if it comes first), Abort and Heartbeat. A worker thread plans
queued send() calls (sender_room.py), submits write batches within `max_inflight_ops`, polls them,
enforces deadlines, sends heartbeats and declares silent decodes dead. After the last batch landed
it sends TransferStatus(SUCCESS, aux) to every destination; a failed room first drains its
in-flight writes, then sends TransferStatus(FAILED): prefill's final word, after which nothing it
sent can still land. poll() reports a room only once it is drained, so freeing pages is safe.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

from kvpipe.transfer.backends.base import BatchState, TransferBackend, TransferError
from kvpipe.transfer.bootstrap import BootstrapError, PrefillRankInfo, register_prefill_rank
from kvpipe.transfer.config import DisaggConfig
from kvpipe.transfer.control import ControlEndpoint
from kvpipe.transfer.layout import KVLayout
from kvpipe.transfer.messages import (Abort, AuxData, Heartbeat, RegisterPeer, Side, TransferRequest,
                                      TransferStatus)
from kvpipe.transfer.messages import TransferState as WireState
from kvpipe.transfer.sender_peers import SenderPeers, expected_destinations
from kvpipe.transfer.sender_room import Destination, Inflight, OpBatch, PlanError, SendCall, SenderRoom
from kvpipe.transfer.state import Clock, DuplicateRoomError, RoomRecord, TransferState, sender_timeouts

log = logging.getLogger(__name__)


@dataclass
class SenderStats:
    rejected_messages: int = 0  # invalid RegisterPeer / TransferRequest / Abort, answered or dropped
    batches_submitted: int = 0
    batches_failed: int = 0
    ops_submitted: int = 0
    bytes_written: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0


class KVSender:
    def __init__(self, cfg: DisaggConfig, *, layout: KVLayout, backend: TransferBackend, tp_rank: int = 0,
                 tp_size: int = 1, model_name: str, instance_id: str | None = None, host: str = "127.0.0.1",
                 clock: Clock = time.monotonic) -> None:
        if instance_id is None:
            if tp_size != 1:
                raise ValueError("with tp_size > 1 every rank needs the same instance_id")
            instance_id = uuid.uuid4().hex[:12]
        self.cfg, self.layout, self.backend = cfg, layout, backend
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.model_name, self.instance_id = model_name, instance_id
        self.session_id = f"{instance_id}/{tp_rank}"  # how decode tells prefill ranks apart
        self.stats = SenderStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._rooms: dict[int, SenderRoom] = {}
        self._tombstones: dict[int, tuple[float, str, set[str]]] = {}  # room -> (expiry, reason, notified)
        self._inflight_ops = 0
        self._timeouts = sender_timeouts(cfg)
        self._orphan_timeouts = {TransferState.BOOTSTRAPPING: cfg.waiting_timeout_s}  # request before add_room
        self._endpoint = ControlEndpoint(host, self._on_message, name=f"kvsender-{tp_rank}",
                                         send_hwm=cfg.control_send_hwm)
        self.peers = SenderPeers(cfg, layout, tp_rank, tp_size, clock())
        self._worker = threading.Thread(target=self._run, name=f"kvsender-{tp_rank}-worker", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def control_address(self) -> str:
        return self._endpoint.address

    @property
    def info(self) -> PrefillRankInfo:
        return PrefillRankInfo(self.tp_rank, self.tp_size, self.layout, self.backend.address,
                               self.control_address, self.model_name, self.instance_id)

    def start(self, bootstrap: tuple[str, int] | None = None) -> "KVSender":
        self._endpoint.start()
        self._worker.start()
        if bootstrap is not None:
            self._register(*bootstrap)
        return self

    def _register(self, host: str, port: int) -> None:
        end = time.monotonic() + self.cfg.bootstrap_timeout_s
        while True:  # the bootstrap server may still be starting
            try:
                return register_prefill_rank(host, port, self.info, self.cfg.http_timeout_s)
            except BootstrapError:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._worker.is_alive():
            self._worker.join(timeout=5.0)
        self._endpoint.close()

    # ---- engine API ------------------------------------------------------------------------

    def add_room(self, room: int, src_pages: np.ndarray | list[int]) -> None:
        pages = np.asarray(src_pages, dtype=np.int64).ravel()
        if pages.size and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            raise ValueError(f"room {room}: source pages outside [0, {self.layout.num_pages})")
        now = self._clock()
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.src_pages is not None:
                raise DuplicateRoomError(f"bootstrap_room {room} is already active on this prefill")
            if r is None:
                r = self._rooms[room] = SenderRoom(room, RoomRecord.new(room, self._timeouts, now), self.layout)
            elif r.rec.state is not TransferState.FAILED:  # the decode's request came first
                r.rec = RoomRecord.new(room, self._timeouts, now)
            r.src_pages = pages
            tomb = self._tombstones.pop(room, None)
            if tomb is not None:
                r.notified |= tomb[2]
                r.rec.fail(f"room {room} was already used or aborted: {tomb[1]}", now)
            if r.ready:
                r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        self._wake.set()

    def send(self, room: int, token_start: int, token_end: int, layer_start: int = 0,
             layer_end: int | None = None, last: bool = False,
             aux: tuple[int, float] | None = None) -> bool:
        """KV of tokens [token_start, token_end) (and all before) is ready in layers [layer_start,
        layer_end). False if the room already failed (poll() will say why)."""
        if last and aux is None:
            raise ValueError(f"room {room}: the last send() carries aux = (first token id, logprob)")
        layer_end = self.layout.num_layers if layer_end is None else layer_end
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.src_pages is None:
                raise KeyError(f"room {room} is not active on this prefill (add_room first)")
            if r.rec.state is TransferState.FAILED:
                return False
            r.add_call(SendCall(token_start, token_end, layer_start, layer_end, last))
            if last:
                r.aux = AuxData(room, int(aux[0]), float(aux[1]))
        self._wake.set()
        return True

    def abort(self, room: int, reason: str = "aborted by prefill") -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            if r.rec.fail(reason, self._clock()):
                for d in r.dests.values():
                    self._endpoint.send(d.control_address, Abort(room, d.session_id, Side.PREFILL, reason))
        self._wake.set()

    def poll(self) -> list[tuple[int, TransferState, str]]:
        """Rooms that finished since the last call and whose pages the engine may free now."""
        out = []
        with self._lock:
            for room, r in list(self._rooms.items()):
                if r.src_pages is None or not r.rec.state.terminal or not r.drained:
                    continue
                if not set(r.dests) <= r.notified:
                    continue
                out.append((room, r.rec.state, r.rec.reason))
                self._bury(r)
        return out

    def room_state(self, room: int) -> TransferState | None:
        """Current state of an active room (None once reported by poll, or unknown)."""
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else r.rec.state

    def num_active_rooms(self) -> int:
        with self._lock:
            return sum(1 for r in self._rooms.values() if r.src_pages is not None)

    # ---- control messages (receive thread) -------------------------------------------------

    def _on_message(self, msg: object) -> None:
        now = self._clock()
        with self._lock:
            if isinstance(msg, Heartbeat):
                self.peers.seen(msg.session_id, now)
            elif isinstance(msg, RegisterPeer):
                why = self.peers.register(msg, now)
                if why is not None:
                    self._reject(f"RegisterPeer from {msg.session_id}: {why}")
            elif isinstance(msg, TransferRequest):
                self.peers.seen(msg.session_id, now)
                self._on_request(msg, now)
            elif isinstance(msg, Abort):
                self.peers.seen(msg.session_id, now)
                self._on_abort(msg, now)
            else:
                self._reject(f"unexpected {type(msg).__name__} on a prefill rank")
        self._wake.set()

    def _reject(self, what: str) -> None:
        self.stats.rejected_messages += 1
        log.warning("prefill rank %d rejected %s", self.tp_rank, what)

    def _status(self, addr: str, room: int, session: str, ok: bool, reason: str = "",
                aux: AuxData | None = None) -> None:
        state = WireState.SUCCESS if ok else WireState.FAILED
        self._endpoint.send(addr, TransferStatus(room, session, state, reason, aux))

    def _on_request(self, msg: TransferRequest, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self._rooms.get(room), self._tombstones.get(room)
        if (r is not None and session in r.dests) or (tomb is not None and session in tomb[2]):
            # This session has (or will get) its final status for the room; a second one would lie.
            self._reject(f"repeated TransferRequest for room {room} from {session}")
            return
        peer, why = self.peers.check_request(msg)
        if why is None:
            why = f"room {room} already finished here ({tomb[1]})" if tomb else self._bind(msg, peer, now)
        if why is None:
            return
        self._reject(f"TransferRequest for room {room} from {session}: {why}")
        addr = peer.control_address if peer is not None else self.peers.reply_address(session)
        if addr is None:
            return  # unknown session: nowhere to answer; its decode times out
        self._status(addr, room, session, False, f"prefill rank {self.tp_rank}: {why}")
        if r is not None:
            r.notified.add(session)
        elif tomb is not None:
            tomb[2].add(session)
        else:  # a later add_room for this room fails at once instead of waiting for a request
            self._tombstones[room] = (now + self._tomb_ttl, f"invalid TransferRequest: {why}", {session})

    def _bind(self, msg: TransferRequest, peer: RegisterPeer, now: float) -> str | None:
        """Attach a validated request to its room; returns why it cannot be, or None."""
        room, session = msg.room, msg.session_id
        r = self._rooms.get(room)
        if r is None:  # the decode is ahead of our engine: keep it until add_room (or time out)
            r = self._rooms[room] = SenderRoom(room, RoomRecord.new(room, self._orphan_timeouts, now), self.layout)
        expected = expected_destinations(self.tp_rank, self.tp_size, peer.tp_size)
        if ((r.expected is not None and r.expected != expected) or len(r.dests) >= expected
                or any(d.decode_rank == peer.tp_rank or d.control_address != peer.control_address
                       for d in r.dests.values())):
            return f"room {room} is already bound to another decode (duplicate bootstrap_room?)"
        r.expected = expected
        r.dests[session] = Destination(session, peer.tp_rank, peer.control_address, peer.data_address,
                                       peer.layout, np.asarray(msg.dst_pages, dtype=np.int64), msg.prefix_len,
                                       self.peers.heads.get(session),
                                       np.full(self.layout.num_layers, msg.prefix_len, dtype=np.int64))
        if r.ready:
            r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        return None

    def _on_abort(self, msg: Abort, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self._rooms.get(room), self._tombstones.get(room)
        if (r is not None and session in r.notified) or (tomb is not None and session in tomb[2]):
            return  # it already has our final status (the abort crossed it on the wire)
        if r is not None and session in r.dests:
            r.rec.fail(f"aborted by decode: {msg.reason}", now)
            return
        addr = self.peers.reply_address(session)
        if r is not None or addr is None:
            self._reject(f"Abort for room {room} from {session}, which is not bound to it")
            return
        # Never saw this room from this session: nothing was written; say so, and remember it so
        # that a late add_room fails at once instead of waiting for a request that never comes.
        self._status(addr, room, session, False, f"prefill rank {self.tp_rank} never wrote room {room}")
        if tomb is None:
            self._tombstones[room] = (now + self._tomb_ttl, f"aborted by decode: {msg.reason}", {session})
        else:
            tomb[2].add(session)

    @property
    def _tomb_ttl(self) -> float:
        return 2 * self.cfg.waiting_timeout_s + self.cfg.bootstrap_timeout_s

    def _bury(self, r: SenderRoom) -> None:
        del self._rooms[r.room]
        what = "succeeded" if r.rec.state is TransferState.SUCCESS else f"failed: {r.rec.reason}"
        self._tombstones[r.room] = (self._clock() + self._tomb_ttl, what, r.notified | set(r.dests))
        if r.src_pages is not None:
            if r.rec.state is TransferState.SUCCESS:
                self.stats.rooms_succeeded += 1
            else:
                self.stats.rooms_failed += 1

    # ---- worker thread: deadlines, heartbeats, planning, the write window ----------------------

    def _run(self) -> None:
        self._hb_seq, self._next_hb = 0, 0.0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                with self._lock:
                    take, cancels, watch = self._tick(self._clock())
                # Backend calls outside the lock: a local submit copies synchronously.
                fresh = [(r, b, *self._submit(b)) for r, b in take]
                for inf, why in cancels:
                    self.backend.cancel(inf.handle, why)
                polled = [(r, inf, self.backend.poll(inf.handle)) for r, inf in watch]
                with self._lock:
                    busy = self._record(fresh, polled, self._clock())
            except Exception:  # never let the worker die: rooms would hang until their deadlines
                log.exception("prefill rank %d transfer worker error", self.tp_rank)
                busy = False
            if busy:
                self._stop.wait(self.cfg.tick_s)
            else:
                self._wake.wait(self.cfg.idle_tick_s)

    def _submit(self, b: OpBatch):
        try:
            return self.backend.submit(b.peer, b.src, b.dst, b.length), None
        except (TransferError, ValueError) as e:
            return None, str(e)

    def _tick(self, now: float):
        for addr in self.peers.liveness.reap(now):
            why = f"decode at {addr} sent nothing for {self.cfg.heartbeat_timeout_s:.1f}s (heartbeats missed)"
            log.warning("prefill rank %d: %s", self.tp_rank, why)
            for r in self._rooms.values():
                if any(d.control_address == addr for d in r.dests.values()):
                    r.rec.fail(why, now)
        if now >= self._next_hb:
            self._next_hb = now + self.cfg.heartbeat_interval_s
            for addr in self.peers.control_addresses():
                self._endpoint.send(addr, Heartbeat(self.session_id, self._hb_seq))
            self._hb_seq += 1
            in_use = {d.control_address for r in self._rooms.values() for d in r.dests.values()}
            for addr in self.peers.prune(now, in_use):
                self._endpoint.disconnect(addr)
            for room in [k for k, t in self._tombstones.items() if t[0] <= now]:
                del self._tombstones[room]
        chunk = max(1, self.cfg.max_inflight_ops // 4)
        cancels, watch, take = [], [], []
        for r in self._rooms.values():
            r.rec.expire(now)
            if r.rec.state is not TransferState.FAILED and r.calls and r.ready:
                try:
                    if r.plan(chunk):
                        r.rec.move(TransferState.TRANSFERRING, now)
                except PlanError as e:
                    r.rec.fail(str(e), now)
            for inf in r.inflight:
                age = now - inf.submitted_at
                if not inf.cancelled and age > self.cfg.transfer_timeout_s:
                    r.rec.fail(f"a write batch of {inf.handle.num_ops} ops made no progress in {age:.1f}s", now)
                if r.rec.state is TransferState.FAILED and not inf.cancelled:
                    inf.cancelled = True
                    cancels.append((inf, r.rec.reason))
                watch.append((r, inf))
            if r.rec.state is TransferState.FAILED:
                r.queued.clear()
                r.calls.clear()
            while r.queued and (self._inflight_ops == 0
                                or self._inflight_ops + r.queued[0].num_ops <= self.cfg.max_inflight_ops):
                b = r.queued.popleft()
                self._inflight_ops += b.num_ops
                r.submitting += 1
                take.append((r, b))
        self._finalize(now)
        return take, cancels, watch

    def _record(self, fresh, polled, now: float) -> bool:
        for r, b, handle, err in fresh:
            r.submitting -= 1
            if handle is None:
                self._inflight_ops -= b.num_ops
                self.stats.batches_failed += 1
                r.rec.fail(f"submitting writes to {b.peer} failed: {err}", now)
                continue
            self.stats.batches_submitted += 1
            self.stats.ops_submitted += b.num_ops
            r.inflight.append(Inflight(handle, now))
        for r, inf, state in polled:
            too_old = inf.cancelled and now - inf.submitted_at > 2 * self.cfg.transfer_timeout_s
            if state is BatchState.PENDING and not too_old:
                continue
            if state is BatchState.PENDING:
                log.error("prefill rank %d: abandoning batch %r that never finished", self.tp_rank, inf.handle)
            r.inflight.remove(inf)
            self._inflight_ops -= inf.handle.num_ops
            if state is BatchState.DONE:
                r.ops_done += inf.handle.num_ops
                r.bytes_done += inf.handle.nbytes
                self.stats.bytes_written += inf.handle.nbytes
            elif state is BatchState.FAILED:
                self.stats.batches_failed += 1
                r.rec.fail(f"write to decode failed: {inf.handle.error}", now)
        self._finalize(now)
        return self._inflight_ops > 0 or any(r.queued for r in self._rooms.values())

    def _finalize(self, now: float) -> None:
        """Send final statuses of drained rooms; forget failed rooms the engine never admitted."""
        for r in list(self._rooms.values()):
            if not r.drained:
                continue
            if r.rec.state is not TransferState.FAILED and r.complete:
                r.rec.move(TransferState.SUCCESS, now)
            if not r.rec.state.terminal:
                continue
            ok = r.rec.state is TransferState.SUCCESS
            for d in r.dests.values():
                if d.session_id not in r.notified:
                    self._status(d.control_address, r.room, d.session_id, ok, "" if ok else r.rec.reason,
                                 r.aux if ok else None)
                    r.notified.add(d.session_id)
            if r.src_pages is None:  # request without add_room that timed out or was aborted
                self._bury(r)
