"""Everything a prefill rank's KVSender decides, without threads, sockets or a backend.

`SenderBook` holds the rooms and reacts to the engine, to control messages and to the clock. It
never performs I/O: control messages go out through the injected `send(address, message)`, write
batches are handed to the caller by `take_work` and their outcomes come back through `record`.
KVSender calls every method under its lock with `now` from its clock.

The book's parts, each in its own module (all pure; the book owns one of each and calls them):
- room.py             one request's destinations, queued sends, cursors, coalesced write batches
- peers.py            the decode sessions registered here, their liveness and head slices
- decode_requests.py  a decode's TransferRequest (bound to its room as a Destination,
                      destinations.py) or Abort; `Replies`: final statuses, refused frames
- session_bounds.py   tombstones of ended rooms and orphan rooms, bounded per decode session
- sessions.py         which sessions and room claims it keeps (mixed in): registrations answer a
                      challenge first (challenge.py), a room goes to its own request's claim (claims.py)
- staged_sends.py     staged chunks (heterogeneous TP): gather -> slot -> one write -> scatter
- stats.py            SenderStats and a succeeded room's TransferTiming
What stays here: the engine side (add_room, add_call, abort, poll), the dispatch of control
messages, and the clock: deadlines and heartbeats (`housekeeping`), planning and the write window
(`take_work`), batch outcomes (`record`) and final statuses (`finalize`).

Protocol rules it keeps (a decode must never reuse pages a write may still land in, and must
hear of every failure):
- every decode session bound to a room gets exactly one final TransferStatus, and only once none
  of our writes for that room can still land (a failed room first drains its in-flight batches);
- a room the engine never admitted (the decode's request came first) that fails is answered and
  forgotten; a tombstone makes a late add_room of it fail at once;
- the engine sees a room in `poll` only when it is drained and its destinations were told;
- a room's final status waits for every staged chunk's scatter the decode acknowledges (or
  transfer_timeout_s), and a chunk's decode slot is released or scattered whatever happens.
Every frame is checked against the session it names (decode_requests.py, staged_sends.py).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.backends.base import BatchHandle, BatchState
from kvpipe.transfer.control.messages import (
    Abort,
    AuxData,
    AuxTuple,
    Heartbeat,
    RegisterPeer,
    Side,
    StagingChunkDone,
    StagingSlotGrant,
    TransferRequest,
)
from kvpipe.transfer.lifecycle import DuplicateRoomError, RoomRecord, TransferState, sender_timeouts
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.window_table import window_pages_problem
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.sender import claims
from kvpipe.transfer.sender.challenge import Challenges
from kvpipe.transfer.sender.decode_requests import DecodeRequests, Replies
from kvpipe.transfer.sender.peers import SenderPeers
from kvpipe.transfer.sender.plan_types import (
    ChunkState,
    Destination,
    Inflight,
    OpBatch,
    PlanError,
    SendCall,
    StagingPolicy,
)
from kvpipe.transfer.sender.revivals import Revivals
from kvpipe.transfer.sender.room import SenderRoom
from kvpipe.transfer.sender.session_bounds import Orphans, Tombstones
from kvpipe.transfer.sender.sessions import SessionRules
from kvpipe.transfer.sender.staged_sends import StagedSends
from kvpipe.transfer.sender.stats import SenderStats, TransferTiming

log = logging.getLogger(__name__)
S, F = TransferState.SUCCESS, TransferState.FAILED


class SenderBook(SessionRules):
    def __init__(
        self,
        cfg: DisaggregationConfig,
        layout: KVLayout,
        tp_rank: int,
        tp_size: int,
        session_id: str,
        send: Callable[[str, Any], bool],
        *,
        control_address: str = "",
        staging: StagingPolicy | None = None,
        staging_addr: int = 0,
        state_layout: StateLayout | None = None,
        own_data_address: str = "",
        draft_layout: KVLayout | None = None,
        draft_at_prefix: bool = False,
        draft_rank: int | None = None,
        digest: Callable[[bytes, np.ndarray, tuple[int, int]], bytes] | None = None,
        reconnect: Callable[[str], None] | None = None,
    ) -> None:
        """`state_layout`: this rank's recurrent-state pool (hybrid models): every room has a
        state slot (add_room) that its decodes get with the KV. `own_data_address`: this rank's
        backend, which no decode may name as its own. `draft_layout`: this rank's draft-model
        pool (STANDALONE speculative decoding): rooms may name draft pages (add_room), sent as
        the layers after the target's (room.py). `draft_at_prefix`: the draft KV lives on the
        target's page ids and a decode's cached prefix holds it too (NEXTN's MTP layer,
        disagg/mtp_transfer.py): its layers are sent from the decode's prefix_len like the
        target's, not from token 0. `draft_rank`: SenderPeers' (NEXTN: the one TP rank of each
        side that holds the draft KV whole; the other prefill ranks send none, and their aux
        data carries no draft fields: the decode takes them from that rank's). `digest(key, src pages,
        global heads)`: the keyed digest of that part of this rank's pool (kv_digest.py), for
        decodes that ask for one (None: they get none, and fail the room). `reconnect(control
        address)`: drop our control connection to a decode, so the next send opens a fresh one
        (revivals.py: a dead decode that speaks again)."""
        self.cfg, self.layout, self.tp_rank, self.tp_size = cfg, layout, tp_rank, tp_size
        self.state_layout = state_layout
        self.draft_layout = draft_layout
        self.draft_at_prefix = draft_at_prefix
        self._digest = digest
        self.session_id = session_id
        self.send = send
        self._reconnect = reconnect
        self.revivals = Revivals()
        self._relinks: list[str] = []  # data addresses the backend should reconnect to (take_relinks)
        self.control_address = control_address  # where staging agents answer
        self.stats = SenderStats()
        self.replies = Replies(send, session_id, tp_rank, self.stats)
        self.staged = StagedSends(
            staging,
            staging_addr,
            tp_rank=tp_rank,
            session_id=session_id,
            control_address=control_address,
            send=send,
            stats=self.stats,
            transfer_timeout_s=cfg.transfer_timeout_s,
        )
        self.peers = SenderPeers(
            cfg, layout, tp_rank, tp_size, state_layout, own_data_address, draft_layout, draft_rank=draft_rank
        )
        self.challenges = Challenges()  # a registration is kept once answered at its control address
        self.rooms: dict[int, SenderRoom] = {}  # insertion order = FIFO for the write window
        self.tombstones = Tombstones(
            cfg.limits.max_tombstones_per_session, 2 * cfg.waiting_timeout_s + cfg.bootstrap_timeout_s, self.stats
        )
        self.orphans = Orphans()
        self.requests = DecodeRequests(
            cfg,
            self.rooms,
            self.peers,
            self.tombstones,
            self.orphans,
            self.replies,
            self._room,
            self._fail_or_drop,
            layout=layout,
            tp_size=tp_size,
            draft_layout=draft_layout,
            draft_at_prefix=draft_at_prefix,
        )
        self.inflight_ops = 0
        self._timeouts = sender_timeouts(cfg)
        self._hb_seq, self._next_hb, self._next_sweep = 0, float("-inf"), float("-inf")
        # A full scan of all rooms (deadlines, planning, final statuses) runs after any event and
        # every idle_tick_s; in between, worker ticks only touch rooms with writes in flight.
        self._busy: dict[int, SenderRoom] = {}  # rooms with planned or in-flight writes
        self._done: dict[int, None] = {}  # rooms poll() may report
        self._dirty = True
        self._next_scan = float("-inf")
        self._peer_progress: dict[str, float] = {}  # data address -> last time a write to it completed
        self._link_busy_since: float | None = None  # start of the current busy period
        self._period_bytes = 0  # bytes landed in the current busy period
        self.timings: collections.deque[TransferTiming] = collections.deque(maxlen=1024)  # succeeded rooms

    # ---- engine side -----------------------------------------------------------------------

    def add_room(
        self,
        room: int,
        pages: np.ndarray,
        now: float,
        state_slot: int | None = None,
        swa_pages: np.ndarray | None = None,
        draft_pages: np.ndarray | None = None,
        claim: bytes | None = None,
    ) -> None:
        """`claim`: the room's messages.room_claim (None: the first decode to ask takes it)."""
        self._dirty = True
        r = self.rooms.get(room)
        if r is not None and r.src_pages is not None:
            raise DuplicateRoomError(f"bootstrap_room {room} is already active on this prefill")
        if r is None:
            r = self.rooms[room] = self._room(room, RoomRecord.new(room, self._timeouts, now))
        elif r.rec.state is not F:  # the decode's request came first: restart the clock now
            r.rec = RoomRecord.new(room, self._timeouts, now)
        r.src_pages = pages
        r.src_state_slot = state_slot
        r.src_swa_pages = swa_pages
        r.src_draft_pages = draft_pages
        r.claim = claim
        self._settle_claims(r, now)
        self.orphans.adopt(room, r.dests)
        tomb = self.tombstones.pop(room)
        if tomb is not None and claims.tomb_applies(tomb.by, tomb.claim, claim):
            r.notified |= tomb.notified
            r.rec.fail(f"room {room} was already used or aborted: {tomb.what}", now)
        if r.ready:
            r.rec.move(TransferState.WAITING_FOR_INPUT, now)

    def add_call(
        self,
        room: int,
        call: SendCall,
        aux: AuxTuple | None,
        pages: np.ndarray | None = None,
        swa_pages: np.ndarray | None = None,
    ) -> bool:
        self._dirty = True
        r = self.rooms.get(room)
        if r is None or r.src_pages is None:
            raise KeyError(f"room {room} is not active on this prefill (add_room first)")
        if r.rec.state is F:
            return False
        if pages is not None:  # the page table grew (pages allocated chunk by chunk)
            old = r.src_pages
            if pages.size < old.size or not np.array_equal(pages[: old.size], old):
                raise ValueError(f"room {room}: a new page table must extend the old one")
        if swa_pages is not None:  # a newer window table: unlike pages, entries may have turned -1 since
            why = window_pages_problem(
                swa_pages,
                self.layout.num_pages,
                r.src_pages if pages is None else pages,
                exact=False,
                aliased=self.layout.aliased,
            )
            if why is not None:
                raise ValueError(f"room {room}: {why}")
            r.src_swa_pages = swa_pages
        if pages is not None:
            r.src_pages = pages
        r.add_call(call)
        if call.last:
            assert aux is not None  # KVSender.send refuses a last call without aux
            cached = int(aux[2]) if len(aux) > 2 else 0
            # NEXTN's (disagg/mtp_transfer.py), from the rank that holds the MTP KV only
            hidden = aux[3] if len(aux) > 3 and self.draft_layout is not None else b""
            r.aux = AuxData(room, int(aux[0]), float(aux[1]), cached, draft_tokens=r.draft_tokens, hidden=hidden)
        return True

    def abort(self, room: int, reason: str, now: float) -> None:
        self._dirty = True
        r = self.rooms.get(room)
        if r is not None and r.rec.fail(reason, now):
            for d in r.dests.values():
                self.send(d.control_address, Abort(room, d.session_id, Side.PREFILL, reason, self.session_id))

    def poll(self, now: float) -> list[tuple[int, TransferState, str]]:
        out = []
        for room in list(self._done):
            del self._done[room]
            r = self.rooms.get(room)
            if r is not None and self._reportable(r):  # else: a late destination, finalize re-adds it
                out.append((room, r.rec.state, r.rec.reason))
                self._bury(r, now)
        return out

    def has_news(self) -> bool:
        """poll() may report a room now."""
        return bool(self._done)

    @staticmethod
    def _reportable(r: SenderRoom) -> bool:
        return r.src_pages is not None and r.rec.state.terminal and r.drained and set(r.dests) <= r.notified

    # ---- control messages ------------------------------------------------------------------

    def on_message(self, msg: object, now: float) -> None:
        self._dirty = not isinstance(msg, Heartbeat) or self._dirty
        self._heard_from(msg)
        if isinstance(msg, Heartbeat):
            self.peers.seen(msg.session_id, now)
        elif isinstance(msg, RegisterPeer):
            self._on_register(msg, now)
        elif isinstance(msg, TransferRequest):
            self.peers.seen(msg.session_id, now)
            self.requests.on_request(msg, now)
        elif isinstance(msg, Abort):
            self.peers.seen(msg.session_id, now)
            self.requests.on_abort(msg, now)
        elif isinstance(msg, (StagingSlotGrant, StagingChunkDone)):
            why = self.staged.on_message(self.rooms.get(msg.room), msg, now)
            if why is not None:
                self.replies.reject(why)
        else:
            self.replies.reject(f"unexpected {type(msg).__name__} on a prefill rank")

    def _heard_from(self, msg: object) -> None:
        """A decode we declared dead speaks again: fresh connections to it before we answer (revivals.py)."""
        if isinstance(msg, RegisterPeer):
            addr: str | None = msg.control_address
        else:
            peer = self.peers.peers.get(getattr(msg, "session_id", ""))
            addr = None if peer is None else peer.control_address
        data = None if addr is None else self.revivals.heard(addr, self.peers)
        if addr is None or data is None:
            return
        log.info(
            "prefill rank %d: decode at %s speaks again after it was declared dead: fresh connections",
            self.tp_rank,
            addr,
        )
        if self._reconnect is not None:
            self._reconnect(addr)
        self._relinks.extend(d for d in data if d not in self._relinks)

    def take_relinks(self) -> list[str]:
        """Data addresses of decodes that came back since the last call: the caller asks its backend to
        drop its connections to them (TransferBackend.relink) before it writes to them again."""
        out, self._relinks = self._relinks, []
        return out

    def _kv_digest(self, r: SenderRoom, d: Destination) -> bytes:
        """The digest a destination asked for of the pages we wrote into it (b"": not asked, or
        we send it no heads, or we cannot: the decode fails the room then)."""
        if not d.integrity_key or d.heads is None or self._digest is None or r.src_pages is None:
            return b""
        first = d.prefix_len // self.layout.page_size
        return self._digest(d.integrity_key, r.src_pages[first : first + len(d.dst_pages)], d.heads)

    def _room(self, room: int, rec: RoomRecord) -> SenderRoom:
        return SenderRoom(room, rec, self.layout, self.state_layout, draft_layout=self.draft_layout)

    def _bury(self, r: SenderRoom, now: float) -> None:
        del self.rooms[r.room]
        self._busy.pop(r.room, None)
        self._done.pop(r.room, None)
        self.orphans.adopt(r.room, r.dests)
        what = "succeeded" if r.rec.state is S else f"failed: {r.rec.reason}"
        # a room our engine never admitted was made by its decode's messages: it counts against that session
        by = next(iter(r.dests), None) if r.src_pages is None else None
        self.tombstones.add(r.room, now, what, r.notified | set(r.dests), by)
        if r.src_pages is not None:
            self.stats.rooms_succeeded += r.rec.state is S
            self.stats.rooms_failed += r.rec.state is F
            if r.rec.state is S:
                self.timings.append(
                    TransferTiming(
                        r.room,
                        r.bytes_done,
                        r.busy_s,
                        r.first_submit_at,
                        r.last_done_at,
                        r.requested_at,
                        tuple(r.busy_spans),
                    )
                )

    # ---- clock: deadlines, liveness, heartbeats, planning, the write window --------------------

    def housekeeping(self, now: float) -> list[str]:
        """Deadlines, dead decodes, expiries; returns decode addresses forgotten for good."""
        for addr in self.peers.liveness.reap(now):
            self.revivals.died(addr)
            why = f"decode at {addr} sent nothing for {self.cfg.heartbeat_timeout_s:.1f}s (heartbeats missed)"
            log.warning("prefill rank %d: %s", self.tp_rank, why)
            for r in list(self.rooms.values()):
                dead = [s for s, d in r.dests.items() if d.control_address == addr]
                if dead:
                    self._fail_or_drop(r, dead, why, now)
                    self._dirty = True
        if now < self._next_sweep:
            return []
        self._next_sweep = now + self.cfg.heartbeat_interval_s
        self.tombstones.expire(now)
        gone = self.peers.prune(
            now, {d.control_address for r in self.rooms.values() for d in r.dests.values()}, self._sessions_in_use()
        )
        self._tell_evicted()
        return gone

    def heartbeats(self, now: float) -> None:
        """One beat to every known decode, at most once per heartbeat interval. The rank's
        `Pulse` thread calls this, never the worker: a pass blocked in a backend call or a
        gather must not silence a live rank (issue 50)."""
        if now < self._next_hb:
            return
        self._next_hb = now + self.cfg.heartbeat_interval_s
        for addr in self.peers.control_addresses():
            self.send(addr, Heartbeat(self.session_id, self._hb_seq))
        self._hb_seq += 1

    def take_work(
        self, now: float
    ) -> tuple[list[tuple[SenderRoom, OpBatch]], list[tuple[Inflight, str]], list[tuple[SenderRoom, Inflight]]]:
        """Plan queued sends; returns (batches to submit, batches to cancel, batches to poll)."""
        chunk = max(1, self.cfg.tuning.max_inflight_ops // 4)  # a few batches in flight keep the link busy
        take, cancels, watch = [], [], []
        full = self._dirty or self.staged.dirty or now >= self._next_scan
        if full:
            self._dirty, self.staged.dirty = False, False
            self._next_scan = now + self.cfg.tuning.idle_tick_s
        rooms = list(self.rooms.values() if full else self._busy.values())
        for r in rooms:
            if r.rec.deadline is not None and now >= r.rec.deadline:
                r.rec.expire(now, self._awaited(r))
            if r.rec.state is not F and r.calls and r.ready:
                try:
                    if r.plan(chunk, self.staged.policy, self.staged.chunk_ids):
                        r.rec.move(TransferState.TRANSFERRING, now)
                except PlanError as e:
                    r.rec.fail(str(e), now)
            if r.staged:
                self.staged.step(r, now)
            for inf in r.inflight:
                # Stalled: nothing to this peer completed since the batch was submitted.
                age = now - max(inf.submitted_at, self._peer_progress.get(inf.handle.peer, inf.submitted_at))
                if not inf.cancelled and age > self.cfg.transfer_timeout_s:
                    r.rec.fail(f"writes to {inf.handle.peer} made no progress for {age:.1f}s", now)
                if r.rec.state is F and not inf.cancelled:
                    inf.cancelled = True
                    cancels.append((inf, r.rec.reason))
                watch.append((r, inf))
            if r.rec.state is F:
                for b in r.queued:
                    if b.chunk is not None:  # granted, never written: give the slot back
                        self.staged.release(r, b.chunk)
                r.queued.clear()
                r.calls.clear()
            while r.queued and (
                self.inflight_ops == 0 or self.inflight_ops + r.queued[0].num_ops <= self.cfg.tuning.max_inflight_ops
            ):
                b = r.queued.popleft()
                if self.inflight_ops == 0 and self._link_busy_since is None:
                    self._link_busy_since = now
                r.mark_busy(now)
                self.inflight_ops += b.num_ops
                r.submitting += 1
                take.append((r, b))
        self.finalize(now, rooms)
        return take, cancels, watch

    def peer_progressed(self, peer: str, now: float) -> None:
        """A write to the data address `peer` completed (a piece of a batch, seen by the backend)."""
        self._peer_progress[peer] = now

    @staticmethod
    def _awaited(r: SenderRoom) -> str:
        if r.src_pages is None:
            return "the prefill engine never admitted the request the decode sent"
        if r.expected is None:
            return "no TransferRequest from the decode"
        return f"only {len(r.dests)} of {r.expected} decode ranks sent a TransferRequest"

    def record(
        self,
        fresh: list[tuple[SenderRoom, OpBatch, BatchHandle | None, str | None]],
        polled: list[tuple[SenderRoom, Inflight, BatchState]],
        now: float,
    ) -> bool:
        """Outcomes of submits and polls; returns True while writes are queued or in flight."""
        for r, b, handle, err in fresh:
            r.submitting -= 1
            if handle is None:
                self.inflight_ops -= b.num_ops
                self.stats.batches_failed += 1
                r.rec.fail(f"submitting writes to {b.peer} failed: {err}", now)
                if b.chunk is not None:
                    self.staged.written(r, b.chunk, False, now)
                continue
            self.stats.batches_submitted += 1
            self.stats.ops_submitted += b.num_ops
            r.inflight.append(Inflight(handle, now, chunk=b.chunk))
        for r, inf, state in polled:
            abandon = inf.cancelled and now - inf.submitted_at > 2 * self.cfg.transfer_timeout_s
            if state is BatchState.PENDING and not abandon:
                continue
            if state is BatchState.PENDING:
                log.error("prefill rank %d: abandoning batch %r that never finished", self.tp_rank, inf.handle)
            r.inflight.remove(inf)
            self.inflight_ops -= inf.handle.num_ops
            if state is BatchState.DONE:
                self._peer_progress[inf.handle.peer] = now
                r.ops_done += inf.handle.num_ops
                r.bytes_done += inf.handle.nbytes
                self.stats.bytes_written += inf.handle.nbytes
                self._period_bytes += inf.handle.nbytes
            elif state is BatchState.FAILED:
                self.stats.batches_failed += 1
                r.rec.fail(f"write to decode failed: {inf.handle.error}", now)
            if inf.chunk is not None:
                self.staged.written(r, inf.chunk, state is BatchState.DONE, now)
        touched = {id(r): r for r, *_ in fresh + polled}.values()
        for r in touched:
            r.mark_idle_if_drained(now)
        if self.inflight_ops == 0 and self._link_busy_since is not None:
            self.stats.busy_s += max(0.0, now - self._link_busy_since)
            self.stats.busy_bytes += self._period_bytes
            self._link_busy_since, self._period_bytes = None, 0
        self.finalize(now, touched)
        # a call gated on a compute event is polled every tick too, so its writes start promptly
        return self.inflight_ops > 0 or any(r.queued or r.waiting_on_compute for r in self._busy.values())

    def finalize(self, now: float, rooms: Iterable[SenderRoom] | None = None) -> None:
        """Send final statuses of drained rooms, note what poll() may report, forget failed rooms
        the engine never admitted. `rooms`: those to look at (default all)."""
        for r in list(self.rooms.values() if rooms is None else rooms):
            if self.rooms.get(r.room) is not r:  # buried meanwhile
                continue
            if (
                r.queued
                or r.inflight
                or r.submitting
                or (r.calls and r.ready and r.rec.state is not F)
                or any(ch.state in (ChunkState.NEW, ChunkState.GRANTED) for ch in r.staged.values())
            ):
                self._busy[r.room] = r
            else:
                self._busy.pop(r.room, None)
            if not r.drained:
                continue
            if r.rec.state is not F and r.complete:
                r.rec.move(S, now)
            if not r.rec.state.terminal:
                continue
            ok = r.rec.state is S
            for d in r.dests.values():
                if d.session_id not in r.notified:
                    self.replies.status(
                        d.control_address,
                        r.room,
                        d.session_id,
                        ok,
                        "" if ok else r.rec.reason,
                        r.aux if ok else None,
                        self._kv_digest(r, d) if ok else b"",
                    )
                    r.notified.add(d.session_id)
            if r.src_pages is None:  # a request without add_room that timed out or was aborted
                self._bury(r, now)
            elif self._reportable(r):
                self._done[r.room] = None
