"""Everything a prefill rank's KVSender decides, without threads, sockets or a backend.

`SenderBook` holds the rooms (room.py), the decode peers (peers.py) and tombstones
of finished rooms, and reacts to control messages and to the clock. It never performs I/O: control
messages go out through the injected `send(address, message)`, write batches are handed to the
caller by `take_work` and their outcomes come back through `record`. KVSender calls every method
under its lock with `now` from its clock.

Protocol rules it keeps (a decode must never reuse pages a write may still land in, and must
hear of every failure):
- every decode session bound to a room gets exactly one final TransferStatus, and only once none
  of our writes for that room can still land (a failed room first drains its in-flight batches);
- a room the engine never admitted (the decode's request came first) that fails is answered and
  forgotten; a tombstone makes a late add_room of it fail at once;
- the engine sees a room in `poll` only when it is drained and its destinations were told;
- a staged chunk (staging/buffers.py) holds local staging bytes from gather to the end of its write and
  a decode ring slot from grant to scatter; whatever happens to its room the slot is released
  (StagingChunkWritten with scatter=False) or scattered, and the room's final status waits for
  every scatter the decode acknowledges (or transfer_timeout_s).

Bounds per decode session (issue 30, cfg.limits): rooms it requested that the engine has not
admitted yet ("orphans": past the bound a request is refused with a failed status) and tombstones
it caused (refused requests, aborts of rooms never seen, orphans that timed out: past the bound its
oldest is forgotten, so a late add_room of that room waits for its request instead of failing at
once). Every frame is checked against the session it names: a request or abort only for the
rooms bound to that session (peers.py binds sessions to registrations); a staging grant or done
only from the agent session the destination announced, with the chunk's nonce.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
    StagingChunkWritten,
    StagingSlotGrant,
    StagingSlotRequest,
    TransferRequest,
    TransferStatus,
    WireState,
)
from kvpipe.transfer.lifecycle import DuplicateRoomError, RoomRecord, TransferState, sender_timeouts
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.planning.window_table import window_pages_problem
from kvpipe.transfer.recurrent.layout import StateLayout
from kvpipe.transfer.sender import claims
from kvpipe.transfer.sender.challenge import Challenges
from kvpipe.transfer.sender.peers import SenderPeers, expected_destinations
from kvpipe.transfer.sender.room import (
    ChunkState,
    Destination,
    Inflight,
    OpBatch,
    PlanError,
    SendCall,
    SenderRoom,
    StagedChunk,
    StagingPolicy,
)
from kvpipe.transfer.sender.sessions import SessionRules
from kvpipe.transfer.staging.ring import RingAllocator

log = logging.getLogger(__name__)
S, F = TransferState.SUCCESS, TransferState.FAILED


@dataclass
class SenderStats:
    rejected_messages: int = 0  # invalid RegisterPeer / TransferRequest / Abort, answered or dropped
    batches_submitted: int = 0
    batches_failed: int = 0
    ops_submitted: int = 0
    bytes_written: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    # Link goodput = busy_bytes / busy_s: seconds with at least one batch in flight and the bytes
    # those batches landed, counted over finished busy periods only (the two always agree).
    busy_s: float = 0.0
    busy_bytes: int = 0
    staged_chunks: int = 0  # staged chunks the decode scattered
    staged_bytes: int = 0
    auth_rejected: int = 0  # control frames the rank's endpoint dropped (no valid tag, stale, replayed)
    foreign_rejected: int = 0  # staging grants / dones not from the chunk's agent session or without its nonce
    orphans_refused: int = 0  # requests refused: their session had max_orphan_rooms_per_session waiting
    tombstones_evicted: int = 0  # a session's oldest tombstones forgotten past max_tombstones_per_session


@dataclass(frozen=True)
class TransferTiming:
    """How a room that succeeded used the link (sender clock, seconds)."""

    room: int
    nbytes: int  # bytes written to every destination
    busy_s: float  # seconds with at least one of its batches in flight
    first_submit_at: float | None
    last_done_at: float | None
    requested_at: float | None = None  # the decode's page tables (all its ranks') had arrived
    busy_spans: tuple[tuple[float, float], ...] = ()  # (start, end) of each stretch of writes in flight


@dataclass
class Tombstone:
    expires_at: float
    what: str  # how the room ended
    notified: set[str]  # decode sessions that already got our final status
    by: str | None = None  # the decode session whose messages made it (None: a room our engine ran)
    claim: bytes | None = None  # the room claim of those messages (claims.tomb_applies)


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
        decodes that ask for one (None: they get none, and fail the room)."""
        self.cfg, self.layout, self.tp_rank, self.tp_size = cfg, layout, tp_rank, tp_size
        self.state_layout = state_layout
        self.draft_layout = draft_layout
        self.draft_at_prefix = draft_at_prefix
        self._digest = digest
        self.session_id = session_id
        self.send = send
        self.control_address = control_address  # where staging agents answer
        # staged sends: the policy, the local staging buffer's base and its allocator
        self.staging, self.staging_addr = staging, staging_addr
        self.local_ring = RingAllocator(staging.local_nbytes) if staging is not None else None
        self._chunk_ids = itertools.count()
        self._gathers: list[tuple[SenderRoom, StagedChunk]] = []  # for the worker: gather, then gathered()
        self.stats = SenderStats()
        self.peers = SenderPeers(
            cfg, layout, tp_rank, tp_size, state_layout, own_data_address, draft_layout, draft_rank=draft_rank
        )
        self.challenges = Challenges()  # a registration is kept once answered at its control address
        self.rooms: dict[int, SenderRoom] = {}  # insertion order = FIFO for the write window
        self.tombstones: dict[int, Tombstone] = {}
        self._limits = cfg.limits
        self._orphans: dict[str, set[int]] = {}  # decode session -> its rooms the engine has not admitted
        self._tombs_by: dict[str, dict[int, None]] = {}  # decode session -> rooms of its tombstones, oldest first
        self.inflight_ops = 0
        self._timeouts = sender_timeouts(cfg)
        self._orphan_timeouts = {TransferState.BOOTSTRAPPING: cfg.waiting_timeout_s}  # request before add_room
        self._tomb_ttl = 2 * cfg.waiting_timeout_s + cfg.bootstrap_timeout_s
        self._hb_seq, self._next_hb = 0, float("-inf")
        # A full scan of all rooms (deadlines, planning, final statuses) runs after any event and
        # every idle_tick_s; in between, worker ticks only touch rooms with writes in flight.
        self._busy: dict[int, SenderRoom] = {}  # rooms with planned or in-flight writes
        self._done: dict[int, None] = {}  # rooms poll() may report
        self._dirty = True
        self._next_scan = float("-inf")
        self._peer_progress: dict[str, float] = {}  # data address -> last time a batch to it completed
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
        self._adopt(r)
        tomb = self._untomb(room)
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
        if isinstance(msg, Heartbeat):
            self.peers.seen(msg.session_id, now)
        elif isinstance(msg, RegisterPeer):
            self._on_register(msg, now)
        elif isinstance(msg, TransferRequest):
            self.peers.seen(msg.session_id, now)
            self._on_request(msg, now)
        elif isinstance(msg, Abort):
            self.peers.seen(msg.session_id, now)
            self._on_abort(msg, now)
        elif isinstance(msg, (StagingSlotGrant, StagingChunkDone)):
            self._on_staging(msg, now)
        else:
            self._reject(f"unexpected {type(msg).__name__} on a prefill rank")

    def _reject(self, what: str) -> None:
        self.stats.rejected_messages += 1
        log.warning("prefill rank %d rejected %s", self.tp_rank, what)

    def _status(
        self,
        addr: str,
        room: int,
        session: str,
        ok: bool,
        reason: str = "",
        aux: AuxData | None = None,
        kv_digest: bytes = b"",
    ) -> None:
        state = WireState.SUCCESS if ok else WireState.FAILED
        self.send(addr, TransferStatus(room, session, state, reason, aux, self.session_id, kv_digest))

    def _kv_digest(self, r: SenderRoom, d: Destination) -> bytes:
        """The digest a destination asked for of the pages we wrote into it (b"": not asked, or
        we send it no heads, or we cannot: the decode fails the room then)."""
        if not d.integrity_key or d.heads is None or self._digest is None or r.src_pages is None:
            return b""
        first = d.prefix_len // self.layout.page_size
        return self._digest(d.integrity_key, r.src_pages[first : first + len(d.dst_pages)], d.heads)

    def _on_request(self, msg: TransferRequest, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self.rooms.get(room), self.tombstones.get(room)
        if (r is not None and session in r.dests) or (tomb is not None and session in tomb.notified):
            # This session has (or will get) its final status for the room; a second one would lie.
            return self._reject(f"repeated TransferRequest for room {room} from {session}")
        peer, why = self.peers.check_request(msg)
        if why is None and tomb is not None and not claims.tomb_applies(tomb.by, tomb.claim, msg.claim or None):
            self._untomb(room)  # a stranger's tombstone of another claim: no word on this request
            tomb = None
        if why is None and tomb is not None:
            why = f"room {room} already finished here ({tomb.what})"
        elif why is None:
            assert peer is not None  # check_request passes only the request of a registered session
            why = self._bind(msg, peer, now)
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
            tomb.notified.add(session)
        elif peer is not None:  # a later add_room for this room fails at once instead of waiting for a request
            self._entomb(
                room,
                Tombstone(
                    now + self._tomb_ttl, f"invalid TransferRequest: {why}", {session}, session, msg.claim or None
                ),
            )

    def _bind(self, msg: TransferRequest, peer: RegisterPeer, now: float) -> str | None:
        """Attach a validated request to its room; returns why it cannot be, or None."""
        room, session = msg.room, msg.session_id
        r = self.rooms.get(room)
        waiting = len(self._orphans.get(session, ()))
        if (r is None or r.src_pages is None) and waiting >= self._limits.max_orphan_rooms_per_session:
            self.stats.orphans_refused += 1
            return (
                f"{waiting} rooms of decode session {session} wait for this prefill's engine "
                f"already (--disaggregation-max-orphan-rooms {self._limits.max_orphan_rooms_per_session})"
            )
        if r is None:  # the decode is ahead of our engine: keep it until add_room (or time out)
            r = self.rooms[room] = self._room(room, RoomRecord.new(room, self._orphan_timeouts, now))
        expected = expected_destinations(self.tp_rank, self.tp_size, peer.tp_size)
        why = claims.conflict(r, peer.control_address, peer.tp_rank, msg.claim, expected)
        if why is not None:
            if not r.dests and r.src_pages is None:  # made for this request only
                del self.rooms[room]
            return why
        if r.expected is None or not r.dests:
            r.expected = expected
        self.peers.used(session, now)
        if r.src_pages is None:
            self._orphans.setdefault(session, set()).add(room)
        swa = None if msg.dst_swa_pages is None else np.asarray(msg.dst_swa_pages, dtype=np.int64)
        lead = 0 if swa is None else swa.size - len(msg.dst_pages)  # check_request: <= prefix pages
        r.dests[session] = Destination(
            session,
            peer.tp_rank,
            peer.control_address,
            peer.data_address,
            peer.layout,
            np.asarray(msg.dst_pages, dtype=np.int64),
            msg.prefix_len,
            self.peers.heads.get(session),
            # target layers from the decode's prefix on, draft layers (if any) from 0 (NEXTN's
            # MTP layer from the prefix too: draft_at_prefix)
            np.concatenate(
                (
                    np.full(self.layout.num_layers, msg.prefix_len, dtype=np.int64),
                    np.full(
                        0 if self.draft_layout is None else self.draft_layout.num_layers,
                        msg.prefix_len if self.draft_at_prefix else 0,
                        dtype=np.int64,
                    ),
                )
            ),
            peer.staging,
            peer.state,
            msg.state_slot,
            None if peer.state is None else np.zeros(peer.state.num_linear, dtype=bool),
            None if swa is None else swa[lead:],
            draft_layout=None if msg.dst_draft_pages is None else peer.draft,
            dst_draft_pages=None if msg.dst_draft_pages is None else np.asarray(msg.dst_draft_pages, dtype=np.int64),
            draft_heads=self.peers.draft_heads.get(session),
            # window pages of logical pages [prefix - lead, prefix): below the decode's prefix
            dst_swa_lead=None if swa is None or lead == 0 else swa[:lead],
            swa_lead_sent=None if swa is None or lead == 0 else np.zeros(self.layout.num_layers, dtype=bool),
            claim=msg.claim,
            expected=expected,
            integrity_key=msg.integrity_key,
        )
        if len(r.dests) >= expected:
            r.requested_at = now
        if r.ready:
            r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        return None

    def _room(self, room: int, rec: RoomRecord) -> SenderRoom:
        return SenderRoom(room, rec, self.layout, self.state_layout, draft_layout=self.draft_layout)

    def _on_abort(self, msg: Abort, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self.rooms.get(room), self.tombstones.get(room)
        if (r is not None and session in r.notified) or (tomb is not None and session in tomb.notified):
            return  # it already has our final status (the abort crossed it on the wire)
        if r is not None and session in r.dests:
            self._fail_or_drop(r, claims.group(r, session), f"aborted by decode: {msg.reason}", now)
            return
        addr = self.peers.reply_address(session)
        if (
            addr is None  # a stranger
            or (r is not None and r.dests)  # a room bound to other sessions
            or (r is not None and r.claim is not None and msg.claim != r.claim)  # another request's room
        ):
            return self._reject(f"Abort for room {room} from {session}, which is not bound to it")
        if r is not None:
            # The decode gave up before it asked for the room (it waited for pages): fail it now
            # rather than hold its KV until the bootstrap timeout; nothing was written.
            r.rec.fail(f"aborted by decode before its request: {msg.reason}", now)
            self._status(addr, room, session, False, f"prefill rank {self.tp_rank} never wrote room {room}")
            r.notified.add(session)
            return
        # Never saw this room from this session: nothing was written; say so, and remember it so
        # that a late add_room fails at once instead of waiting for a request that never comes.
        self._status(addr, room, session, False, f"prefill rank {self.tp_rank} never wrote room {room}")
        if tomb is None:
            self._entomb(
                room,
                Tombstone(
                    now + self._tomb_ttl, f"aborted by decode: {msg.reason}", {session}, session, msg.claim or None
                ),
            )
        else:
            tomb.notified.add(session)

    def _adopt(self, r: SenderRoom) -> None:
        """The room is no orphan of its sessions any more (admitted, or gone)."""
        for session in r.dests:
            self._disown(session, r.room)

    def _entomb(self, room: int, tomb: Tombstone) -> None:
        """Remember how `room` ended; a session past its bound forgets its oldest tombstone."""
        self._untomb(room)
        self.tombstones[room] = tomb
        if tomb.by is None:
            return
        mine = self._tombs_by.setdefault(tomb.by, {})
        mine[room] = None
        while len(mine) > self._limits.max_tombstones_per_session:
            old = next(iter(mine))
            del mine[old]
            self.tombstones.pop(old, None)
            self.stats.tombstones_evicted += 1

    def _untomb(self, room: int) -> Tombstone | None:
        tomb = self.tombstones.pop(room, None)
        if tomb is not None and tomb.by is not None:
            mine = self._tombs_by.get(tomb.by)
            if mine is not None:
                mine.pop(room, None)
                if not mine:
                    del self._tombs_by[tomb.by]
        return tomb

    def _bury(self, r: SenderRoom, now: float) -> None:
        del self.rooms[r.room]
        self._busy.pop(r.room, None)
        self._done.pop(r.room, None)
        self._adopt(r)
        what = "succeeded" if r.rec.state is S else f"failed: {r.rec.reason}"
        # a room our engine never admitted was made by its decode's messages: it counts against that session
        by = next(iter(r.dests), None) if r.src_pages is None else None
        self._entomb(r.room, Tombstone(now + self._tomb_ttl, what, r.notified | set(r.dests), by))
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
        """Deadlines, dead decodes, heartbeats; returns decode addresses forgotten for good."""
        for addr in self.peers.liveness.reap(now):
            why = f"decode at {addr} sent nothing for {self.cfg.heartbeat_timeout_s:.1f}s (heartbeats missed)"
            log.warning("prefill rank %d: %s", self.tp_rank, why)
            for r in list(self.rooms.values()):
                dead = [s for s, d in r.dests.items() if d.control_address == addr]
                if dead:
                    self._fail_or_drop(r, dead, why, now)
                    self._dirty = True
        if now < self._next_hb:
            return []
        self._next_hb = now + self.cfg.heartbeat_interval_s
        for addr in self.peers.control_addresses():
            self.send(addr, Heartbeat(self.session_id, self._hb_seq))
        self._hb_seq += 1
        for room in [k for k, t in self.tombstones.items() if t.expires_at <= now]:
            self._untomb(room)
        gone = self.peers.prune(
            now, {d.control_address for r in self.rooms.values() for d in r.dests.values()}, self._sessions_in_use()
        )
        self._tell_evicted()
        return gone

    def take_work(
        self, now: float
    ) -> tuple[list[tuple[SenderRoom, OpBatch]], list[tuple[Inflight, str]], list[tuple[SenderRoom, Inflight]]]:
        """Plan queued sends; returns (batches to submit, batches to cancel, batches to poll)."""
        chunk = max(1, self.cfg.tuning.max_inflight_ops // 4)  # a few batches in flight keep the link busy
        take, cancels, watch = [], [], []
        full = self._dirty or now >= self._next_scan
        if full:
            self._dirty, self._next_scan = False, now + self.cfg.tuning.idle_tick_s
        rooms = list(self.rooms.values() if full else self._busy.values())
        for r in rooms:
            if r.rec.deadline is not None and now >= r.rec.deadline:
                r.rec.expire(now, self._awaited(r))
            if r.rec.state is not F and r.calls and r.ready:
                try:
                    if r.plan(chunk, self.staging, self._chunk_ids):
                        r.rec.move(TransferState.TRANSFERRING, now)
                except PlanError as e:
                    r.rec.fail(str(e), now)
            if r.staged:
                self._step_chunks(r, now)
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
                        self._release(r, b.chunk)
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

    # ---- staged chunks: gather -> slot -> one write -> scatter ---------------------------------

    def take_gathers(self) -> list[tuple[SenderRoom, StagedChunk]]:
        """Chunks whose slices the worker must gather into local staging now (then `gathered`)."""
        out, self._gathers = self._gathers, []
        return out

    def gathered(self, done: list[tuple[SenderRoom, StagedChunk, str | None]], now: float) -> None:
        """The worker gathered these chunks (or failed: why): ask their agents for slots."""
        for r, ch, err in done:
            if err is not None:
                r.rec.fail(f"staging gather failed: {err}", now)
            dest = r.dests[ch.dest]
            if r.rec.state is F:
                self._finish_chunk(r, ch)
                continue
            assert dest.staging is not None
            ch.state, ch.since = ChunkState.WAIT_SLOT, now
            self.send(
                dest.staging.control_address,
                StagingSlotRequest(r.room, self.session_id, ch.chunk, ch.nbytes, self.control_address, ch.nonce),
            )
        self._dirty = True

    def _step_chunks(self, r: SenderRoom, now: float) -> None:
        """Move a room's staged chunks on: local space for new ones, writes for granted ones;
        a failed room releases what it can and waits for what it cannot."""
        failed = r.rec.state is F
        for ch in list(r.staged.values()):
            st, age = ch.state, now - ch.since
            if failed:
                if st is ChunkState.NEW:
                    self._finish_chunk(r, ch)
                elif st in (ChunkState.WAIT_SLOT, ChunkState.GRANTED):
                    self._release(r, ch)
                elif st is ChunkState.WAIT_DONE and age > self.cfg.transfer_timeout_s:
                    log.warning(
                        "prefill rank %d: decode never confirmed the scatter of chunk %d (room %d)",
                        self.tp_rank,
                        ch.chunk,
                        r.room,
                    )
                    self._finish_chunk(r, ch)
                continue  # GATHERING / WRITING: their outcome comes back through gathered / record
            if st in (ChunkState.WAIT_SLOT, ChunkState.WAIT_DONE) and age > self.cfg.transfer_timeout_s:
                what = "no staging slot granted" if st is ChunkState.WAIT_SLOT else "the chunk was not scattered"
                r.rec.fail(
                    f"decode rank {r.dests[ch.dest].decode_rank}: {what} within {self.cfg.transfer_timeout_s:.0f}s", now
                )
                return self._step_chunks(r, now)
            if st is ChunkState.NEW:
                assert self.local_ring is not None
                slot = self.local_ring.alloc(ch.nbytes)  # chunks are sized to fit (room.py, SenderRoom._stage)
                if slot is None:
                    continue  # local staging is full: wait for writes to finish
                ch.local, ch.state, ch.since = slot, ChunkState.GATHERING, now
                self._gathers.append((r, ch))
            elif st is ChunkState.GRANTED:  # one op, queued behind the room's page ops
                assert ch.local is not None and ch.offset is not None
                dest = r.dests[ch.dest]
                assert dest.staging is not None
                ch.state, ch.since = ChunkState.WRITING, now
                one = lambda v: np.asarray([v], dtype=np.int64)  # noqa: E731
                r.queued.append(
                    OpBatch(
                        dest.data_address,
                        one(self.staging_addr + ch.local.offset),
                        one(dest.staging.pool_addr + ch.offset),
                        one(ch.nbytes),
                        ch,
                    )
                )

    def _on_staging(self, msg: StagingSlotGrant | StagingChunkDone, now: float) -> None:
        r = self.rooms.get(msg.room)
        ch = r.staged.get(msg.chunk) if r is not None else None
        if r is None or ch is None:
            return  # a chunk released meanwhile (its agent frees the slot on our release)
        agent = r.dests[ch.dest].staging
        if agent is None or msg.session_id != agent.session_id or msg.nonce != ch.nonce:
            self.stats.foreign_rejected += 1
            return self._reject(
                f"{type(msg).__name__} for chunk {msg.chunk} of room {msg.room} from session "
                f"{msg.session_id!r:.80}: not the chunk's staging agent, or not its nonce"
            )
        if isinstance(msg, StagingSlotGrant):
            if ch.state is not ChunkState.WAIT_SLOT:
                return self._reject(f"staging grant for chunk {msg.chunk} in state {ch.state.value}")
            if not msg.ok:
                r.rec.fail(f"decode rank {r.dests[ch.dest].decode_rank} refused a staging slot: {msg.reason}", now)
                return self._finish_chunk(r, ch)
            staging = r.dests[ch.dest].staging
            assert staging is not None
            ch.state, ch.since, ch.offset = ChunkState.GRANTED, now, msg.offset
            if msg.offset + ch.nbytes > staging.pool_nbytes:
                self._reject(f"staging grant for chunk {msg.chunk} at {msg.offset} overruns the decode's ring")
                r.rec.fail(
                    f"staging slot at {msg.offset} for {ch.nbytes} bytes overruns the decode's "
                    f"{staging.pool_nbytes}-byte ring",
                    now,
                )
                self._release(r, ch)
            return
        if ch.state is not ChunkState.WAIT_DONE:
            return self._reject(f"staging done for chunk {msg.chunk} in state {ch.state.value}")
        if msg.ok:
            self.stats.staged_chunks += 1
            self.stats.staged_bytes += ch.nbytes
        else:
            r.rec.fail(
                f"decode rank {r.dests[ch.dest].decode_rank} could not scatter a staged chunk: {msg.reason}", now
            )
        self._finish_chunk(r, ch)

    def _written(self, r: SenderRoom, ch: StagedChunk, ok: bool, now: float) -> None:
        """The chunk's write ended: announce it for scattering, or (room failed) release the slot."""
        if not ok or r.rec.state is F:
            return self._release(r, ch)
        dest = r.dests[ch.dest]
        assert dest.staging is not None and self.local_ring is not None and ch.local is not None
        self.local_ring.free(ch.local.slot_id)  # the bytes are on the decode now
        ch.local, ch.state, ch.since = None, ChunkState.WAIT_DONE, now
        self.send(
            dest.staging.control_address,
            StagingChunkWritten(
                r.room,
                ch.chunk,
                self.session_id,
                self.control_address,
                True,
                tuple(ch.dst_pages.tolist()),
                ch.dst_col,
                ch.ncols,
                ch.l0,
                ch.l1,
                ch.nonce,
            ),
        )

    def _release(self, r: SenderRoom, ch: StagedChunk) -> None:
        staging = r.dests[ch.dest].staging
        assert staging is not None
        self.send(
            staging.control_address,
            StagingChunkWritten(r.room, ch.chunk, self.session_id, self.control_address, False, nonce=ch.nonce),
        )
        self._finish_chunk(r, ch)

    def _finish_chunk(self, r: SenderRoom, ch: StagedChunk) -> None:
        if ch.local is not None and self.local_ring is not None:
            self.local_ring.free(ch.local.slot_id)
            ch.local = None
        r.staged.pop(ch.chunk, None)
        self._dirty = True

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
                    self._written(r, b.chunk, False, now)
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
                self._written(r, inf.chunk, state is BatchState.DONE, now)
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
                    self._status(
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
