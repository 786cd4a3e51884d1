"""The part of a prefill rank's SenderBook that decides which decode sessions and room claims it
keeps (issue 45): registrations answer a challenge first (challenge.py), the session table evicts
for newcomers and idleness (peers.py), and a room goes to the claim group of its own request
(claims.py). Bookkeeping only, like the rest of the book; SenderBook calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvpipe.transfer.control.messages import RegisterPeer, RegisterReply, RegisterState
from kvpipe.transfer.sender import claims
from kvpipe.transfer.sender.challenge import Challenges
from kvpipe.transfer.sender.decode_requests import Replies
from kvpipe.transfer.sender.peers import SenderPeers
from kvpipe.transfer.sender.room import SenderRoom
from kvpipe.transfer.sender.session_bounds import Orphans


class SessionRules:
    """Mixed into SenderBook, whose state it works on."""

    send: Callable[[str, Any], bool]
    session_id: str
    tp_rank: int
    peers: SenderPeers
    challenges: Challenges
    rooms: dict[int, SenderRoom]
    _busy: dict[int, SenderRoom]
    orphans: Orphans
    replies: Replies

    def _on_register(self, msg: RegisterPeer, now: float) -> None:
        """Challenge a registration (challenge.py), then register it (peers.py) and say how it went."""

        def reply(state: RegisterState, challenge: bytes = b"", reason: str = "") -> None:
            self.send(msg.control_address, RegisterReply(msg.session_id, self.session_id, state, challenge, reason))

        if not self.challenges.answered(msg, now):
            return reply(RegisterState.CHALLENGE, self.challenges.issue(msg, now))
        why = self.peers.register(replace(msg, challenge=b""), now, self._sessions_in_use())
        self._tell_evicted()
        if why is not None:
            self.replies.reject(f"RegisterPeer from {msg.session_id}: {why}")
            return reply(RegisterState.REFUSED, reason=f"prefill rank {self.tp_rank}: {why}")
        reply(RegisterState.ACCEPTED)

    def _sessions_in_use(self) -> set[str]:
        """Sessions bound to rooms our engine admitted (never evicted while such a room is open)."""
        return {s for r in self.rooms.values() if r.src_pages is not None for s in r.dests}

    def _tell_evicted(self) -> None:
        """Sessions the peers evicted: drop their claims on rooms not admitted yet (their decode asks
        again once registered again) and tell them."""
        for peer in self.peers.take_evicted():
            s = peer.session_id
            for r in list(self.rooms.values()):
                if s in r.dests and r.src_pages is None:
                    del r.dests[s]
                    if not r.dests:
                        del self.rooms[r.room]
                        self._busy.pop(r.room, None)
            self.orphans.drop(s)
            reason = f"prefill rank {self.tp_rank} evicted the idle session (register again to use it)"
            self.send(peer.control_address, RegisterReply(s, self.session_id, RegisterState.EVICTED, reason=reason))

    def _settle_claims(self, r: SenderRoom, now: float) -> None:
        """The engine admitted the room: keep the claim group it belongs to, refuse the others."""
        gone = claims.losers(r)
        for s in gone:
            d = r.dests.pop(s)
            self.replies.status(
                d.control_address,
                r.room,
                s,
                False,
                f"prefill rank {self.tp_rank}: room {r.room} belongs to another request (its claim differs)",
            )
            r.notified.add(s)
            self.orphans.adopt(r.room, [s])
        if r.dests:
            r.expected = next(iter(r.dests.values())).expected
        elif gone:
            r.expected = None

    def _fail_or_drop(self, r: SenderRoom, sessions: list[str], reason: str, now: float) -> None:
        """`sessions` of the room gave up (an abort, their decode died): before admission, while
        another claim group waits for the room, only their group goes (with its final statuses);
        otherwise the room fails."""
        if r.src_pages is None and claims.other_groups(r, sessions):
            for s in sessions:
                d = r.dests.pop(s)
                self.replies.status(d.control_address, r.room, s, False, reason)
                r.notified.add(s)
                self.orphans.adopt(r.room, [s])
            return
        r.rec.fail(reason, now)
