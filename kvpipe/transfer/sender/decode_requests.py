"""A decode's TransferRequest and Abort for a room, as a prefill rank decides them without I/O:
bind the request to its room (a `Destination`), or refuse it with a failed status and remember
that; fail the room an abort names, or answer an abort of a room never written.

Rules (SenderBook's docstring has the protocol as a whole): a session gets at most one final
status per room, so a repeated request is dropped; a request or abort counts only for the rooms
bound to the session that sends it (peers.py binds sessions to registrations); a room the engine
has not admitted yet is an orphan of its session until add_room, and a session past
max_orphan_rooms_per_session gets its new requests refused (session_bounds.py). `Replies` is how
the book answers decodes and counts what it refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvpipe.config import DisaggregationConfig
from kvpipe.transfer.control.messages import Abort, AuxData, RegisterPeer, TransferRequest, TransferStatus, WireState
from kvpipe.transfer.lifecycle import RoomRecord, TransferState
from kvpipe.transfer.planning.layout import KVLayout
from kvpipe.transfer.sender import claims
from kvpipe.transfer.sender.destinations import destination
from kvpipe.transfer.sender.peers import SenderPeers, expected_destinations
from kvpipe.transfer.sender.room import SenderRoom
from kvpipe.transfer.sender.session_bounds import Orphans, Tombstones
from kvpipe.transfer.sender.stats import SenderStats

log = logging.getLogger(__name__)


class Replies:
    """How a prefill rank answers its decodes: final statuses, and frames it refuses (counted, logged)."""

    def __init__(self, send: Callable[[str, Any], bool], session_id: str, tp_rank: int, stats: SenderStats) -> None:
        self.send, self.session_id, self.tp_rank, self.stats = send, session_id, tp_rank, stats

    def status(
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

    def reject(self, what: str) -> None:
        self.stats.rejected_messages += 1
        log.warning("prefill rank %d rejected %s", self.tp_rank, what)


class DecodeRequests:
    def __init__(
        self,
        cfg: DisaggregationConfig,
        rooms: dict[int, SenderRoom],
        peers: SenderPeers,
        tombstones: Tombstones,
        orphans: Orphans,
        replies: Replies,
        new_room: Callable[[int, RoomRecord], SenderRoom],
        fail_or_drop: Callable[[SenderRoom, list[str], str, float], None],
        *,
        layout: KVLayout,
        tp_size: int,
        draft_layout: KVLayout | None = None,
        draft_at_prefix: bool = False,
    ) -> None:
        """`rooms`, `tombstones`, `orphans`: SenderBook's, changed in place; `new_room`: how it
        makes a room; `fail_or_drop(room, sessions, reason, now)`: how sessions of a room give up
        (SessionRules); `layout`, `draft_layout`, `draft_at_prefix`: as SenderBook's."""
        self.rooms, self.peers, self.tombstones, self.orphans = rooms, peers, tombstones, orphans
        self.replies, self.new_room, self.fail_or_drop = replies, new_room, fail_or_drop
        self.layout, self.draft_layout, self.draft_at_prefix = layout, draft_layout, draft_at_prefix
        self.tp_rank, self.tp_size = replies.tp_rank, tp_size
        self.max_orphans = cfg.limits.max_orphan_rooms_per_session
        self._orphan_timeouts = {TransferState.BOOTSTRAPPING: cfg.waiting_timeout_s}  # request before add_room

    def on_request(self, msg: TransferRequest, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self.rooms.get(room), self.tombstones.get(room)
        if (r is not None and session in r.dests) or (tomb is not None and session in tomb.notified):
            # This session has (or will get) its final status for the room; a second one would lie.
            return self.replies.reject(f"repeated TransferRequest for room {room} from {session}")
        peer, why = self.peers.check_request(msg)
        if why is None and tomb is not None and not claims.tomb_applies(tomb.by, tomb.claim, msg.claim or None):
            self.tombstones.pop(room)  # a stranger's tombstone of another claim: no word on this request
            tomb = None
        if why is None and tomb is not None:
            why = f"room {room} already finished here ({tomb.what})"
        elif why is None:
            assert peer is not None  # check_request passes only the request of a registered session
            why = self._bind(msg, peer, now)
        if why is None:
            return
        self.replies.reject(f"TransferRequest for room {room} from {session}: {why}")
        addr = peer.control_address if peer is not None else self.peers.reply_address(session)
        if addr is None:
            return  # unknown session: nowhere to answer; its decode times out
        self.replies.status(addr, room, session, False, f"prefill rank {self.tp_rank}: {why}")
        if r is not None:
            r.notified.add(session)
        elif tomb is not None:
            tomb.notified.add(session)
        elif peer is not None:  # a later add_room for this room fails at once instead of waiting for a request
            self.tombstones.add(room, now, f"invalid TransferRequest: {why}", {session}, session, msg.claim or None)

    def _bind(self, msg: TransferRequest, peer: RegisterPeer, now: float) -> str | None:
        """Attach a validated request to its room; returns why it cannot be, or None."""
        room, session = msg.room, msg.session_id
        r = self.rooms.get(room)
        waiting = self.orphans.count(session)
        if (r is None or r.src_pages is None) and waiting >= self.max_orphans:
            self.replies.stats.orphans_refused += 1
            return (
                f"{waiting} rooms of decode session {session} wait for this prefill's engine "
                f"already (--disaggregation-max-orphan-rooms {self.max_orphans})"
            )
        if r is None:  # the decode is ahead of our engine: keep it until add_room (or time out)
            r = self.rooms[room] = self.new_room(room, RoomRecord.new(room, self._orphan_timeouts, now))
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
            self.orphans.add(session, room)
        r.dests[session] = destination(
            msg,
            peer,
            self.layout,
            self.peers.heads.get(session),
            draft_layout=self.draft_layout,
            draft_at_prefix=self.draft_at_prefix,
            draft_heads=self.peers.draft_heads.get(session),
            expected=expected,
        )
        if len(r.dests) >= expected:
            r.requested_at = now
        if r.ready:
            r.rec.move(TransferState.WAITING_FOR_INPUT, now)
        return None

    def on_abort(self, msg: Abort, now: float) -> None:
        room, session = msg.room, msg.session_id
        r, tomb = self.rooms.get(room), self.tombstones.get(room)
        if (r is not None and session in r.notified) or (tomb is not None and session in tomb.notified):
            return  # it already has our final status (the abort crossed it on the wire)
        if r is not None and session in r.dests:
            self.fail_or_drop(r, claims.group(r, session), f"aborted by decode: {msg.reason}", now)
            return
        addr = self.peers.reply_address(session)
        if (
            addr is None  # a stranger
            or (r is not None and r.dests)  # a room bound to other sessions
            or (r is not None and r.claim is not None and msg.claim != r.claim)  # another request's room
        ):
            return self.replies.reject(f"Abort for room {room} from {session}, which is not bound to it")
        if r is not None:
            # The decode gave up before it asked for the room (it waited for pages): fail it now
            # rather than hold its KV until the bootstrap timeout; nothing was written.
            r.rec.fail(f"aborted by decode before its request: {msg.reason}", now)
            self.replies.status(addr, room, session, False, f"prefill rank {self.tp_rank} never wrote room {room}")
            r.notified.add(session)
            return
        # Never saw this room from this session: nothing was written; say so, and remember it so
        # that a late add_room fails at once instead of waiting for a request that never comes.
        self.replies.status(addr, room, session, False, f"prefill rank {self.tp_rank} never wrote room {room}")
        if tomb is None:
            self.tombstones.add(room, now, f"aborted by decode: {msg.reason}", {session}, session, msg.claim or None)
        else:
            tomb.notified.add(session)
