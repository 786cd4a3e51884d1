"""Rooms a decode refused, on the prefill: from the bootstrap server's thread to the engine's.

A decode that refuses the prefill's handshake (transfer/control/handshake.py) posts a
`RefusalNotice` to the prefill's bootstrap server for the rooms it refused. The decode may be
ahead of the prefill's engine (the router posts the request to both at once), so a refusal can
come before the prefill admitted the room or while it computes; `RefusedRooms` keeps each refused
room until the connector acts on it at whichever of those comes (`pop`: at admission, or when the
engine thread takes the news), or for `ttl_s` (a request that never comes). The connector learns of new
refusals with `take_new` on the engine thread. Bounded (oldest forgotten first), thread-safe.
A refusal counts only for the request whose claim it names (messages.room_claim: `pop`): a holder
of the token who learnt a room id cannot fail another decode's request with a notice (issue 45).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvpipe.transfer.control.handshake import REFUSED, Handshake, RefusalNotice, compare, describe

MAX_REFUSED = 4096  # refused rooms remembered at once (one notice names at most this many)


def refusal_reason(notice: RefusalNotice, mine: Handshake | None) -> tuple[str, str]:
    """(message, /metrics label) of a decode's refusal as the prefill tells it: compared here when
    the decode sent its handshake (the same message, both sides' values, as the decode's), else
    the decode's own words, marked as a refusal whatever they say."""
    if mine is not None and notice.handshake is not None:
        mismatches = compare(mine, notice.handshake)
        if mismatches:
            return describe(mismatches), mismatches[0].reason
    reason = notice.reason if REFUSED in notice.reason else f"{REFUSED} by the decode: {notice.reason}"
    return reason, notice.label


class RefusedRooms:
    def __init__(self, ttl_s: float, max_rooms: int = MAX_REFUSED, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl, self._max, self._clock = ttl_s, max_rooms, clock
        self._lock = threading.Lock()
        # room -> (expires at, reason, the room claim the notice named)
        self._rooms: OrderedDict[int, tuple[float, str, bytes | None]] = OrderedDict()
        self._new: list[int] = []  # refused since the last take_new
        self.counts: dict[str, int] = {}  # refused rooms by /metrics label

    def add(self, rooms: Iterable[int], reason: str, label: str, claims: Iterable[bytes | None] | None = None) -> None:
        """Any thread (the bootstrap server's): these rooms were refused for `reason`; `claims`:
        the room claim the notice named for each (None: none, then it fails no request)."""
        rooms = list(rooms)
        claim_list = list(claims) if claims is not None else [None] * len(rooms)
        with self._lock:
            now = self._clock()
            while self._rooms and next(iter(self._rooms.values()))[0] <= now:
                self._rooms.popitem(last=False)
            for room, claim in zip(rooms, claim_list, strict=True):
                self._rooms[room] = (now + self._ttl, reason, claim)
                self._rooms.move_to_end(room)
                self._new.append(room)
                if claim is not None:  # a notice without claims fails nothing: not counted either
                    self.counts[label] = self.counts.get(label, 0) + 1
            while len(self._rooms) > self._max:
                self._rooms.popitem(last=False)
            del self._new[: max(0, len(self._new) - self._max)]

    def take_new(self) -> list[int]:
        """Rooms refused since the last call (the engine thread acts on those it holds)."""
        with self._lock:
            new, self._new = self._new, []
            return new

    def pop(self, room: int, claim: bytes) -> str | None:
        """The reason `room`, whose request has `claim`, was refused (once); None if it was not,
        long ago, or by a notice that named another claim (or none)."""
        with self._lock:
            got = self._rooms.pop(room, None)
        return got[1] if got is not None and got[0] > self._clock() and got[2] == claim else None

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
