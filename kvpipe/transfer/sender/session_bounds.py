"""What a prefill rank remembers for its decode sessions, and how much (issue 30, cfg.limits):
`Tombstones`, how finished rooms ended (a late add_room of one fails at once, a second request
for one is refused), and `Orphans`, rooms a decode asked for that the engine has not admitted yet.

A session may cause at most max_tombstones_per_session tombstones (refused requests, aborts of
rooms never seen, orphans that timed out; past the bound its oldest is forgotten, so a late
add_room of that room waits for its request instead of failing at once) and hold at most
max_orphan_rooms_per_session orphans (SenderBook refuses requests past it). Rooms our engine ran
are entombed for no session and count against none. Plain Python; SenderBook owns both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, ValuesView
from dataclasses import dataclass

from kvpipe.transfer.sender.stats import SenderStats


@dataclass
class Tombstone:
    expires_at: float
    what: str  # how the room ended
    notified: set[str]  # decode sessions that already got our final status
    by: str | None = None  # the decode session whose messages made it (None: a room our engine ran)
    claim: bytes | None = None  # the room claim of those messages (claims.tomb_applies)


class Tombstones:
    """room -> Tombstone, with each session's tombstones in order (oldest first) for its bound."""

    def __init__(self, per_session: int, ttl_s: float, stats: SenderStats) -> None:
        """`ttl_s`: how long a tombstone is kept; `stats.tombstones_evicted` counts the forgotten."""
        self.per_session, self.ttl_s, self.stats = per_session, ttl_s, stats
        self._tombs: dict[int, Tombstone] = {}
        self._by: dict[str, dict[int, None]] = {}  # decode session -> rooms of its tombstones, oldest first

    def get(self, room: int) -> Tombstone | None:
        return self._tombs.get(room)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tombs)

    def __len__(self) -> int:
        return len(self._tombs)

    def values(self) -> ValuesView[Tombstone]:
        return self._tombs.values()

    def add(
        self, room: int, now: float, what: str, notified: set[str], by: str | None = None, claim: bytes | None = None
    ) -> None:
        """Remember how `room` ended (`what`), for `ttl_s`; `notified`: the decode sessions that
        got our final status; `by`: the session it counts against (its oldest may be forgotten);
        `claim`: the room claim of `by`'s messages (a stranger's tombstone binds no other claim)."""
        self.pop(room)
        self._tombs[room] = Tombstone(now + self.ttl_s, what, notified, by, claim)
        if by is None:
            return
        mine = self._by.setdefault(by, {})
        mine[room] = None
        while len(mine) > self.per_session:
            old = next(iter(mine))
            del mine[old]
            self._tombs.pop(old, None)
            self.stats.tombstones_evicted += 1

    def pop(self, room: int) -> Tombstone | None:
        tomb = self._tombs.pop(room, None)
        if tomb is not None and tomb.by is not None:
            mine = self._by.get(tomb.by)
            if mine is not None:
                mine.pop(room, None)
                if not mine:
                    del self._by[tomb.by]
        return tomb

    def expire(self, now: float) -> None:
        for room in [k for k, t in self._tombs.items() if t.expires_at <= now]:
            self.pop(room)


class Orphans:
    """decode session -> its rooms the engine has not admitted yet."""

    def __init__(self) -> None:
        self._rooms: dict[str, set[int]] = {}

    def count(self, session: str) -> int:
        return len(self._rooms.get(session, ()))

    def add(self, session: str, room: int) -> None:
        self._rooms.setdefault(session, set()).add(room)

    def adopt(self, room: int, sessions: Iterable[str]) -> None:
        """`room` is no orphan of these sessions any more (admitted, or gone)."""
        for session in sessions:
            rooms = self._rooms.get(session)
            if rooms is not None:
                rooms.discard(room)
                if not rooms:
                    del self._rooms[session]

    def drop(self, session: str) -> None:
        """Forget every orphan of `session` (evicted: its decode asks again once registered)."""
        self._rooms.pop(session, None)

    def __len__(self) -> int:
        """Sessions with orphans."""
        return len(self._rooms)
