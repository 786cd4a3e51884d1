"""A decode's registrations with one prefill instance: which (prefill rank, decode rank) pairs the
prefill accepted, and the rooms that wait until every pair is (plain bookkeeping for ReceiverBook).

A prefill rank registers a decode session only once the decode answered its challenge at the
control address the registration names (sender/challenge.py), and may later evict an idle session
for another (sender/peers.py). So a TransferRequest goes out only when every pair of the TP
mapping was accepted (RegisterReply ACCEPTED); rooms opened before wait here, and a refusal fails
them with the prefill's reason. An evicted pair registers again when a room needs it, and the
rooms it had asked for and not heard from that pair again are asked for again once it is back
(the eviction dropped their claims on the prefill, which had not admitted them yet). A challenge is
answered at most MAX_CHALLENGES times per attempt: a peer that keeps challenging gets no loop. An
attempt no answer came for (a frame lost to a full queue or a dropped connection) is made again
after `retry_s`, when a room needs the pair.

A room that fails before its request went out (the client left, its bootstrap deadline passed)
is still held by the prefill, which only its own bootstrap timeout would free; a prefill rank
takes an Abort only from a session it registered, so such aborts wait in `aborts` until every
pair is accepted (a refusal drops them: the prefill never knew this decode, only its timeout
frees the room).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpipe.transfer.control.messages import RegisterPeer
from kvpipe.transfer.receiver.room import ReceiverRoom

Pair = tuple[int, int]  # (prefill rank, decode rank)
PendingAbort = tuple[int, str, bytes]  # room, reason, the request's claim
MAX_CHALLENGES = 3


@dataclass
class Registration:
    pairs: tuple[Pair, ...]  # the TP mapping's (rank_pairs)
    messages: tuple[RegisterPeer, ...]  # per decode rank: its registration (without a challenge)
    accepted: set[Pair] = field(default_factory=set)
    pending: dict[Pair, float] = field(default_factory=dict)  # sent (when), no answer yet
    challenges: dict[Pair, int] = field(default_factory=dict)  # challenges answered in this attempt
    queued: list[ReceiverRoom] = field(default_factory=list)  # rooms waiting for every pair
    again: dict[Pair, set[int]] = field(default_factory=dict)  # rooms to ask for again once re-accepted
    aborts: list[PendingAbort] = field(default_factory=list)  # rooms that failed unrequested, to tell once ready

    @property
    def ready(self) -> bool:
        return len(self.accepted) == len(self.pairs)

    def to_send(self, now: float, retry_s: float) -> list[Pair]:
        """Pairs to send the registration to now: not accepted, and not waiting for an answer to one
        sent less than `retry_s` ago (a new attempt)."""
        out = [
            pair
            for pair in self.pairs
            if pair not in self.accepted and now - self.pending.get(pair, float("-inf")) >= retry_s
        ]
        for pair in out:
            self.pending[pair] = now
            self.challenges.pop(pair, None)
        return out

    def challenged(self, pair: Pair) -> bool:
        """Whether to answer a challenge for `pair` (False: accepted already, or asked too often)."""
        if pair in self.accepted or pair not in self.pending or self.challenges.get(pair, 0) >= MAX_CHALLENGES:
            return False
        self.challenges[pair] = self.challenges.get(pair, 0) + 1
        return True

    def answered(self, pair: Pair, ok: bool) -> None:
        """The prefill accepted (ok) or refused the pair's registration; this attempt is over."""
        self.pending.pop(pair, None)
        self.challenges.pop(pair, None)
        if ok:
            self.accepted.add(pair)

    def evicted(self, pair: Pair, rooms: set[int]) -> None:
        """The prefill forgot the pair's session; `rooms`: those to ask for again once it is back."""
        self.accepted.discard(pair)
        self.pending.pop(pair, None)
        self.challenges.pop(pair, None)
        if rooms:
            self.again.setdefault(pair, set()).update(rooms)

    def take_queued(self) -> list[ReceiverRoom]:
        out, self.queued = self.queued, []
        return out

    @property
    def wanted(self) -> bool:
        """Whether rooms wait for this registration (to be requested, or to be aborted)."""
        return bool(self.queued or self.aborts)

    def take_aborts(self) -> list[PendingAbort]:
        out, self.aborts = self.aborts, []
        return out

    def take_again(self) -> dict[Pair, set[int]]:
        out, self.again = self.again, {}
        return out
