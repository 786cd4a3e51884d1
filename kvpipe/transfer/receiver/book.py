"""Everything the decode's KVReceiver decides, without threads, sockets or HTTP.

`ReceiverBook` holds the rooms (room.py), the prefill instances known from their
bootstrap servers, the rooms waiting for a bootstrap fetch, prefill liveness and the heartbeat
sequence, and reacts to the engine, to control messages, to fetch outcomes and to the clock. It
never performs I/O: control messages go out through the injected `send(address, message)`;
`add_room` returns the bootstrap address whose fetch the caller must start (one fetch per
prefill at a time), and the caller hands the outcome back with `on_fetched`. KVReceiver calls
every method under its lock with `now` from its clock.

Flow: the first room for a prefill waits for its bootstrap info; once it is known (and
compatible) every (prefill rank, decode rank) pair of the TP rank mapping gets RegisterPeer once
per prefill instance, then every room a TransferRequest per pair. Prefill ranks answer with one
final TransferStatus per pair (room.py). Rules it keeps:
- poll() reports a room only when it is safe to reuse its pages: after Success, or after a
  failure once every paired prefill rank gave its final word, the prefill restarted, or
  transfer_timeout_s passed since the failure;
- a failure (deadline, abort, a prefill rank's Failed) sends Abort to the paired prefill ranks,
  unless they all answered already or the instance is gone; a room that fails before its
  request went out is aborted too, once the prefill accepted our registration (a rank takes an
  Abort only from a session it registered), so it does not hold the request to its bootstrap timeout;
- a prefill rank that misses heartbeats is dead: its instance's rooms fail but keep their pages
  (a silent prefill may be stalled with writes in flight) and the instance is forgotten, so the
  next add_room fetches the bootstrap info again; a new instance id there proves the old one
  gone and frees the old rooms' pages at once.

Session ids: prefill rank p is f"{prefill_instance_id}/{p}" (KVSender; the bootstrap server lists
the instance). Decode rank r registers with each prefill instance under a session of its own,
f"{instance_id}/{r}/" + 128 random bits, sent to that instance's ranks only. A room remembers the
sessions it was requested under; a TransferStatus or Abort counts only when it names the room's
session of its decode rank and, as `sender`, a prefill rank of that instance that the TP mapping
pairs with it, once per pair (`stats.foreign_rejected` counts the others): a holder of the token
who never saw the request cannot finish, fail or forge the aux data of another session's room.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control.bootstrap_address import BootstrapAddress
from kvpipe.transfer.control.messages import (
    Abort,
    AuxData,
    DecodeRank,
    Heartbeat,
    RegisterPeer,
    RegisterReply,
    RegisterState,
    Side,
    TransferRequest,
    TransferStatus,
)
from kvpipe.transfer.lifecycle import DuplicateRoomError, PeerLiveness, RoomRecord, TransferState, receiver_timeouts
from kvpipe.transfer.receiver.lost import LostPrefills
from kvpipe.transfer.receiver.registration import Pair, PendingAbort, Registration
from kvpipe.transfer.receiver.room import ReceiverRoom, rank_pairs
from kvpipe.transfer.receiver.room_checks import RoomChecks
from kvpipe.transfer.receiver.stats import ReceiverStats

if TYPE_CHECKING:  # bootstrap pulls in the HTTP stack; the book only reads the fetched info
    from kvpipe.transfer.control.bootstrap import PrefillInstanceInfo

log = logging.getLogger(__name__)
Address = BootstrapAddress  # a prefill's bootstrap server: host, port (parsed strictly)
MAX_STALE_CONTROLS = 4096  # prefill ranks dropped for silence whose connection is replaced when known again


@dataclass
class KnownPrefill:
    """A prefill instance whose bootstrap info was fetched and whose ranks we registered with."""

    addr: Address
    info: PrefillInstanceInfo
    sessions: dict[str, int]  # prefill session id -> prefill rank
    mine: tuple[str, ...] = ()  # per decode rank: our session with this instance (random, never published)
    reg: Registration = field(default_factory=lambda: Registration((), ()))  # which pairs it accepted


class ReceiverBook(RoomChecks):
    def __init__(
        self,
        cfg: DisaggregationConfig,
        ranks: Sequence[DecodeRank],
        instance_id: str,
        control_address: str,
        send: Callable[[str, Any], bool],
        verify: Callable[[ReceiverRoom], str | None] | None = None,
        reconnect: Callable[[str], None] | None = None,
    ) -> None:
        """`verify(room)`: why a room whose prefill ranks all reported Success holds other KV than
        they wrote, or None (kv_digest.py; rooms requested with an integrity key only).
        `reconnect(control address)`: drop our connection to a prefill rank, so the next send
        opens a fresh one (called when a prefill dropped for silence is known again)."""
        self.cfg, self.ranks = cfg, tuple(ranks)
        self._verify = verify
        self.tp_size = len(self.ranks)
        self.control_address = control_address  # where prefill ranks answer (in RegisterPeer)
        self.send = send
        # per decode rank: the prefix of its sessions (each prefill instance gets its own, KnownPrefill.mine)
        self.sessions = [f"{instance_id}/{r}" for r in range(self.tp_size)]
        self.stats = ReceiverStats()
        self.rooms: dict[int, ReceiverRoom] = {}
        self.prefills: dict[Address, KnownPrefill] = {}
        self.liveness = PeerLiveness[str](cfg.heartbeat_timeout_s)  # per prefill session
        self._timeouts = receiver_timeouts(cfg)
        self._by_session: dict[str, tuple[Address, int]] = {}  # prefill session -> (addr, prefill rank)
        self._waiting: dict[Address, list[ReceiverRoom]] = {}  # rooms waiting for a bootstrap fetch
        self._fetch_errors: dict[Address, str] = {}  # last error of a fetch still retrying
        self._hb_seq, self._next_hb = 0, float("-inf")
        self._reconnect = reconnect
        # control addresses of prefill ranks dropped for silence: after a partition our connection
        # to one may sit in TCP's retransmission back-off, which held a registration sent after the
        # heal for 12 s (issue 50, docs/faults.md); it is replaced when that prefill is known again
        self._stale_controls: set[str] = set()
        # prefills dropped for silence, looked for again (lost.py): readiness, and no request needed to
        # register with one again after a heal
        self.lost = LostPrefills(max(1.0, cfg.heartbeat_interval_s), 10 * cfg.heartbeat_timeout_s)
        self._refetching: set[Address] = set()  # looks (take_refetches) whose fetch has not ended

    # ---- engine side (add_room's checks: room_checks.py) -------------------------------------

    def add_room(
        self,
        room: int,
        prefill: Address,
        pages: tuple[np.ndarray, ...],
        prefix_len: int,
        aux_slot: int,
        now: float,
        state_slot: int | None = None,
        swa_pages: tuple[np.ndarray, ...] | None = None,
        draft_pages: np.ndarray | None = None,
        claim: bytes = b"",
        integrity_key: bytes = b"",
    ) -> Address | None:
        """Open a room (pages from check_pages, swa_pages from check_swa_pages). Returns `prefill`
        when the caller must start a bootstrap fetch of it (then report with on_fetched), None when
        the room was requested at once or a fetch of that prefill is under way. Raises
        DuplicateRoomError."""
        if room in self.rooms:
            raise DuplicateRoomError(f"bootstrap_room {room} is already active on this decode")
        r = self.rooms[room] = ReceiverRoom(
            room,
            RoomRecord.new(room, self._timeouts, now),
            prefill,
            pages,
            prefix_len,
            aux_slot,
            state_slot,
            swa_pages=swa_pages,
            draft_pages=draft_pages,
            claim=claim,
            integrity_key=integrity_key,
        )
        peer = self.prefills.get(prefill)
        if peer is not None:
            self._request(r, peer, now)
            return None
        waiting = self._waiting.setdefault(prefill, [])
        waiting.append(r)
        if len(waiting) > 1:
            return None  # a fetch of this prefill is in flight already
        self.stats.bootstrap_fetches += 1
        return prefill

    def abort(self, room: int, reason: str, now: float) -> None:
        r = self.rooms.get(room)
        if r is not None:
            r.rec.fail(reason, now)
            self._settle(r, now)

    def abort_unrequested(self, room: int, prefill: Address, reason: str, claim: bytes = b"") -> bool:
        """A request that never got a room here is gone: Abort to the prefill's paired ranks if
        that prefill is known (it frees the room's KV at once), else nothing to tell (its bootstrap
        timeout frees it)."""
        peer = self.prefills.get(prefill)
        if room in self.rooms or peer is None:
            return False
        return self._tell_unrequested(peer, (room, reason, claim))

    def _tell_unrequested(self, peer: KnownPrefill, abort: PendingAbort) -> bool:
        """Abort a room the prefill was never asked for on every paired rank: now if they all
        accepted our registration, else once they have (registration.py). True once sent or queued."""
        if not peer.reg.ready:
            peer.reg.aborts.append(abort)
            return True
        room, reason, claim = abort
        return self._to_pairs(peer.info, lambda rank: Abort(room, peer.mine[rank], Side.DECODE, reason, claim=claim))

    def poll(self, now: float) -> list[tuple[int, TransferState, str, AuxData | None]]:
        """Rooms that finished and whose pages are safe to reuse (each reported once)."""
        out = []
        for room, r in list(self.rooms.items()):
            if not r.rec.state.terminal or not r.quiet(now):
                continue
            ok = r.rec.state is TransferState.SUCCESS
            if ok and r.integrity_key:  # before the first decode step reads the pages
                why = "no KV digest checker on this decode" if self._verify is None else self._verify(r)
                if why is not None:
                    log.warning("room %d: %s", room, why)
                    r.rec.fail(why, now)
                    self.stats.integrity_failed += 1
                    ok = False
            out.append((room, r.rec.state, r.rec.reason, r.aux if ok else None))
            del self.rooms[room]
            if ok:
                self.stats.rooms_succeeded += 1
            else:
                self.stats.rooms_failed += 1
        return out

    def has_news(self, now: float) -> bool:
        """Whether poll() would report a room now."""
        return any(r.rec.state.terminal and r.quiet(now) for r in self.rooms.values())

    def room_state(self, room: int) -> TransferState | None:
        r = self.rooms.get(room)
        return None if r is None else r.rec.state

    def num_active_rooms(self) -> int:
        return len(self.rooms)

    # ---- bootstrap, registration, requests ---------------------------------------------------

    def fetch_retrying(self, prefill: Address, error: str) -> None:
        """A fetch failed in a way worth retrying (server starting); a room that times out
        waiting for it names this error."""
        self._fetch_errors[prefill] = error

    def on_fetched(
        self, prefill: Address, info: PrefillInstanceInfo | None, error: str | None, now: float
    ) -> list[int]:
        """The fetch add_room asked for ended: `info` fetched and compatible, or None and why not.
        Requests every room waiting for it, or fails them; returns the rooms it failed (nothing
        was registered or requested for them: a refused handshake tells the prefill so)."""
        # A room that was reported and whose id came back (maybe for another prefill) is a new
        # room: only the very objects that waited, still active, are requested.
        waited = self._waiting.pop(prefill, [])
        rooms = [r for r in waited if self.rooms.get(r.room) is r and not r.requested and not r.rec.state.terminal]
        self._fetch_errors.pop(prefill, None)
        self._refetching.discard(prefill)
        if info is None:
            why = f"bootstrap with prefill {prefill[0]}:{prefill[1]} failed: {error or 'no answer'}"
            log.log(logging.WARNING if waited else logging.DEBUG, "%s (%d rooms)", why, len(rooms))
            for r in rooms:
                r.rec.fail(why, now)
            return [r.room for r in rooms]
        peer = self._install(prefill, info, now)
        for r in rooms:
            self._request(r, peer, now)
        for r in waited:  # failed while the fetch ran (client gone): the prefill still holds them
            if r.rec.state is TransferState.FAILED and self.rooms.get(r.room) in (None, r):
                self._tell_unrequested(peer, (r.room, r.rec.reason, r.claim))
        return []

    def _install(self, addr: Address, info: PrefillInstanceInfo, now: float) -> KnownPrefill:
        if addr in self.lost.since:
            log.info("prefill at %s:%d answers again: registering on fresh connections", addr[0], addr[1])
        self.lost.found(addr)
        old = self.prefills.get(addr)
        if old is not None and old.info.instance_id == info.instance_id:
            return old
        if old is not None:
            self._drop_prefill(
                old,
                f"prefill at {addr[0]}:{addr[1]} restarted (instance {old.info.instance_id} -> {info.instance_id})",
                now,
                gone=True,
            )
        for r in self.rooms.values():  # rooms of an instance dropped earlier: now known to be gone
            if r.prefill == addr and r.instance_id not in (None, info.instance_id):
                r.prefill_gone = True
                r.rec.fail(f"prefill at {addr[0]}:{addr[1]} restarted", now)
        for rank in info.ranks:
            if rank.control_address in self._stale_controls:
                self._stale_controls.discard(rank.control_address)
                if self._reconnect is not None:
                    self._reconnect(rank.control_address)
        mine = tuple(f"{self.sessions[r]}/{secrets.token_hex(16)}" for r in range(self.tp_size))
        regs = tuple(
            RegisterPeer(
                mine[r],
                r,
                self.tp_size,
                self.ranks[r].data_address,
                self.control_address,
                self.ranks[r].layout,
                self.ranks[r].staging,
                self.ranks[r].state,
                draft=self.ranks[r].draft,
            )
            for r in range(self.tp_size)
        )
        peer = KnownPrefill(
            addr,
            info,
            {f"{info.instance_id}/{p}": p for p in range(info.tp_size)},
            mine,
            Registration(tuple(rank_pairs(info.tp_size, self.tp_size)), regs),
        )
        self._register(peer, now)
        for s, p in peer.sessions.items():
            self._by_session[s] = (addr, p)
            # a prefill is heard only once it has our registration, which may take up to the
            # bootstrap timeout (after a healed partition TCP resends at its backed-off RTO, seconds
            # late): until then its rooms' bootstrap deadline judges it, not the heartbeat timeout
            # (which dropped it 2.5 s after the heal, its answer already on the way: issue 50)
            self.liveness.track(s, now + max(0.0, self.cfg.bootstrap_timeout_s - self.cfg.heartbeat_timeout_s))
        self.prefills[addr] = peer
        return peer

    def _register(self, peer: KnownPrefill, now: float) -> None:
        """Send the registration of every pair that is neither accepted nor awaiting an answer (one
        unanswered for a heartbeat interval is sent again)."""
        for p, r in peer.reg.to_send(now, self.cfg.heartbeat_interval_s):
            self.send(peer.info.ranks[p].control_address, peer.reg.messages[r])
            self.stats.registrations += 1

    def _transfer_request(self, r: ReceiverRoom, peer: KnownPrefill, rank: int) -> TransferRequest:
        return TransferRequest(
            r.room,
            peer.mine[rank],
            tuple(r.dst_pages[rank].tolist()),
            r.prefix_len,
            r.aux_slot,
            r.state_slot,
            None if r.swa_pages is None else tuple(r.swa_pages[rank].tolist()),
            dst_draft_pages=(
                None if r.draft_pages is None or self.ranks[rank].draft is None else tuple(r.draft_pages.tolist())
            ),
            claim=r.claim,
            integrity_key=r.integrity_key,
        )

    def _request(self, r: ReceiverRoom, peer: KnownPrefill, now: float) -> None:
        if not peer.reg.ready:  # every pair's registration must be accepted first (registration.py)
            peer.reg.queued.append(r)
            self._register(peer, now)
            return
        info = peer.info
        queued = self._to_pairs(info, lambda rank: self._transfer_request(r, peer, rank))
        r.requested_from(info.instance_id, info.tp_size, self.tp_size, peer.mine)
        r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        if not queued:
            r.rec.fail(f"control queue to prefill {peer.addr[0]}:{peer.addr[1]} is full", now)
            self._settle(r, now)

    def _drop_prefill(self, peer: KnownPrefill, why: str, now: float, gone: bool) -> None:
        """Fail the rooms of a prefill instance and forget it (the next add_room fetches again).

        gone=True (it restarted): nothing of the old process can land any more, pages are free at
        once. gone=False (silent): it may only be stalled with writes in flight, so its rooms keep
        their pages until it answers our Abort or transfer_timeout_s passed."""
        log.warning("%s", why)
        for r in peer.reg.take_queued():  # never requested: nothing can land
            r.rec.fail(why, now)
        for r in self.rooms.values():
            if r.prefill == peer.addr and r.instance_id == peer.info.instance_id:
                r.prefill_gone = r.prefill_gone or gone
                r.rec.fail(why, now)
                self._settle(r, now)
        for s in peer.sessions:
            self._by_session.pop(s, None)
            self.liveness.forget(s)
        if not gone and len(self._stale_controls) < MAX_STALE_CONTROLS:
            self._stale_controls.update(rank.control_address for rank in peer.info.ranks)
        if not gone:
            self.lost.lost(peer.addr, now)
        if self.prefills.get(peer.addr) is peer:
            del self.prefills[peer.addr]  # the next add_room fetches the bootstrap info again

    def _settle(self, r: ReceiverRoom, now: float) -> None:
        """After a failure: start the quiet deadline and ask the prefill ranks to stop writing."""
        if r.rec.state is not TransferState.FAILED or r.quiet_deadline is not None:
            return
        r.quiet_deadline = now + self.cfg.transfer_timeout_s
        peer = self.prefills.get(r.prefill)
        if not r.requested:  # waiting for our registration: told once it is accepted (waiting for
            # the bootstrap fetch: told by on_fetched); the prefill otherwise holds it until its timeout
            if peer is not None and any(q is r for q in peer.reg.queued):
                self._tell_unrequested(peer, (r.room, r.rec.reason, r.claim))
            return
        if r.all_final or r.prefill_gone or peer is None or peer.info.instance_id != r.instance_id:
            return
        self._to_pairs(peer.info, lambda rank: Abort(r.room, r.sessions[rank], Side.DECODE, r.rec.reason))
        r.aborts_sent = True

    def _to_pairs(self, info: PrefillInstanceInfo, make: Callable[[int], Any]) -> bool:
        """Send `make(decode rank)` to the prefill rank of every (prefill rank, decode rank) pair
        of the TP mapping; True when every message was queued."""
        queued = [self.send(info.ranks[p].control_address, make(r)) for p, r in rank_pairs(info.tp_size, self.tp_size)]
        return all(queued)  # a list first: every pair gets its message, also after a refused one

    # ---- control messages --------------------------------------------------------------------

    def _reject(self, what: str) -> None:
        self.stats.rejected_messages += 1
        log.warning("decode rejected %s", what)

    def on_message(self, msg: object, now: float) -> None:
        if isinstance(msg, Heartbeat):
            if msg.session_id in self._by_session:
                if self.liveness.seen(msg.session_id, now):
                    log.info("prefill session %s is alive again", msg.session_id)
            return
        if isinstance(msg, RegisterReply):
            return self._on_register_reply(msg, now)
        if not isinstance(msg, (TransferStatus, Abort)):
            return self._reject(f"unexpected {type(msg).__name__} on a decode")
        r = self.rooms.get(msg.room)
        if r is None or not r.requested:
            return self._reject(
                f"{type(msg).__name__} for room {msg.room}, session {msg.session_id:.80}: room not awaiting a transfer"
            )
        if isinstance(msg, Abort) and msg.side is not Side.PREFILL:
            return self._reject(f"Abort for room {msg.room} claiming to come from {msg.side.value}")
        pair = r.pair_of(msg.session_id, msg.sender)
        if pair is None:
            self.stats.foreign_rejected += 1
            return self._reject(
                f"{type(msg).__name__} for room {msg.room} from {msg.sender!r:.80} naming session "
                f"{msg.session_id!r:.80}: not a (prefill rank, decode session) pair the room was requested from"
            )
        rank, p = pair
        if isinstance(msg, Abort):
            r.rec.fail(f"aborted by prefill: {msg.reason}", now)
        else:
            why = r.on_status(rank, p, msg, now)
            if why is not None:
                return self._reject(f"TransferStatus for room {msg.room}: {why}")
        self._settle(r, now)

    def _on_register_reply(self, msg: RegisterReply, now: float) -> None:
        """A prefill rank's word on one of our registrations (registration.py)."""
        known = self._by_session.get(msg.sender)
        peer = self.prefills.get(known[0]) if known is not None else None
        rank = peer.mine.index(msg.session_id) if peer is not None and msg.session_id in peer.mine else None
        if peer is None or known is None or rank is None or (known[1], rank) not in peer.reg.pairs:
            self.stats.foreign_rejected += 1
            return self._reject(f"RegisterReply from {msg.sender!r:.80} for session {msg.session_id!r:.80}: not ours")
        pair: Pair = (known[1], rank)
        reg, where = peer.reg, peer.info.ranks[pair[0]].control_address
        self.liveness.seen(msg.sender, now)  # it answered: from now on the heartbeat timeout judges it
        if msg.state is RegisterState.CHALLENGE:
            if reg.challenged(pair):
                self.send(where, replace(reg.messages[rank], challenge=msg.challenge))
            return None
        if msg.state is RegisterState.EVICTED:
            rooms = {
                r.room
                for r in self.rooms.values()
                if r.requested
                and r.prefill == peer.addr
                and r.instance_id == peer.info.instance_id
                and not r.rec.state.terminal
                and (rank, pair[0]) not in r.reported
            }
            log.info("prefill rank %d evicted our session of decode rank %d (%d rooms to ask again)", *pair, len(rooms))
            reg.evicted(pair, rooms)
            if rooms:
                self._register(peer, now)
            return None
        reg.answered(pair, msg.state is RegisterState.ACCEPTED)
        if msg.state is RegisterState.REFUSED:
            why = f"prefill rank {pair[0]} refused the registration of decode rank {rank}: {msg.reason}"
            log.warning("%s", why)
            for r in reg.take_queued():
                r.rec.fail(why, now)
            reg.take_aborts()  # it never knew this decode: only its bootstrap timeout frees those rooms
        elif reg.ready:
            for room, why, claim in reg.take_aborts():
                live = self.rooms.get(room)
                if live is None or live.rec.state.terminal:  # not an id a new room of ours took since
                    self._tell_unrequested(peer, (room, why, claim))
            for r in reg.take_queued():
                if self.rooms.get(r.room) is r and not r.requested and not r.rec.state.terminal:
                    self._request(r, peer, now)
            for (p, r_rank), rooms in reg.take_again().items():
                for room in rooms:
                    again = self.rooms.get(room)
                    if again is not None and again.requested and not again.rec.state.terminal:
                        self.send(peer.info.ranks[p].control_address, self._transfer_request(again, peer, r_rank))
        return None

    # ---- clock: deadlines, liveness, heartbeats ------------------------------------------------

    def housekeeping(self, now: float) -> None:
        for r in self.rooms.values():
            if r.rec.state is TransferState.BOOTSTRAPPING and r.rec.deadline is not None and now >= r.rec.deadline:
                err = self._fetch_errors.get(r.prefill)
                peer = self.prefills.get(r.prefill)
                if err is None and peer is not None and not peer.reg.ready:
                    err = "the prefill has not accepted this decode's registration"
                r.rec.fail(
                    f"bootstrap with prefill {r.prefill[0]}:{r.prefill[1]} failed: not done "
                    f"within {self.cfg.bootstrap_timeout_s}s" + (f" ({err})" if err else ""),
                    now,
                )
            r.rec.expire(now, "not every prefill rank reported the transfer finished")
            self._settle(r, now)
        for s in self.liveness.reap(now):
            known = self._by_session.get(s)
            if known is None:
                continue
            addr, p = known
            peer = self.prefills.get(addr)
            if peer is not None and s in peer.sessions:
                self._drop_prefill(
                    peer,
                    f"prefill rank {p} at {addr[0]}:{addr[1]} sent no "
                    f"heartbeat for {self.cfg.heartbeat_timeout_s:.1f}s",
                    now,
                    gone=False,
                )
        for peer in self.prefills.values():  # rooms wait for a registration no answer came for
            if peer.reg.wanted and not peer.reg.ready:
                self._register(peer, now)

    def take_refetches(self, now: float) -> list[Address]:
        """Prefills dropped for silence to look for now (lost.py): the caller fetches each once and
        reports through on_fetched, which installs and registers one that answers."""
        out = self.lost.due(now, self._refetching | set(self._waiting) | set(self.prefills))
        self._refetching.update(out)
        return out

    def unreachable(self, now: float) -> str | None:
        """Why this decode has no prefill to serve with (its readiness), or None: it knows one, or
        none yet (a decode that was never asked for a prefill is ready)."""
        return None if self.prefills else self.lost.problem(now)

    def heartbeats(self, now: float) -> None:
        """One beat per prefill rank, at most once per heartbeat interval. The receiver's `Pulse`
        thread calls this, not the worker (whose housekeeping may wait on the lock)."""
        if now < self._next_hb:
            return
        self._next_hb = now + self.cfg.heartbeat_interval_s
        for peer in self.prefills.values():
            # one beat per prefill rank, in the name of a decode rank paired with it
            for p, rank in dict(rank_pairs(peer.info.tp_size, self.tp_size)).items():
                self.send(peer.info.ranks[p].control_address, Heartbeat(peer.mine[rank], self._hb_seq))
        self._hb_seq += 1
