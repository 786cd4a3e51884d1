"""When a room of a TP prefill instance is over: every rank's KVSender reports it once (pure bookkeeping).

Each prefill TP rank writes its own head slice of a room's KV and reports the room on its own
(KVSender.poll: Success, or Failed once none of its writes can still land). The engine may free
the room's pages only when *every* rank is done with them, so the instance-level outcome is:
- Success when all ranks reported Success;
- Failed when all ranks reported and one of them failed (reason: the first failure heard);
and the first failure is announced once (`report` returns True) so that the caller aborts the
room on the other ranks at once instead of letting them run into their own deadlines.
A rank that is gone (its process exited) can write nothing more: it counts as Failed for every
room it has not reported, including rooms added later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpipe.transfer.lifecycle import TransferState


@dataclass
class _Votes:
    outcomes: dict[int, tuple[TransferState, str]] = field(default_factory=dict)  # rank -> (state, reason)
    failure: str | None = None  # the first failure heard, "prefill TP rank r: why"


class RoomTally:
    def __init__(self, tp_size: int) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self._rooms: dict[int, _Votes] = {}
        self._finished: dict[int, None] = {}  # rooms every rank reported, in completion order
        self.gone: dict[int, str] = {}  # rank -> why it can no longer report

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def add(self, room: int) -> bool:
        """Track a new room; returns True when it has failed already (a rank is gone)."""
        if room in self._rooms:
            raise ValueError(f"room {room} is already tracked")
        self._rooms[room] = _Votes()
        failed = False
        for rank, why in self.gone.items():
            failed |= self.report(rank, room, TransferState.FAILED, why)
        return failed

    def discard(self, room: int) -> None:
        """Forget a room that never started (its add_room was refused)."""
        self._rooms.pop(room, None)
        self._finished.pop(room, None)

    def report(self, rank: int, room: int, state: TransferState, reason: str = "") -> bool:
        """Rank `rank` is done with `room`. Returns True if this is the room's first failure.
        Reports for unknown rooms and repeated reports are ignored."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} outside [0, {self.tp_size})")
        if state not in (TransferState.SUCCESS, TransferState.FAILED):
            raise ValueError(f"rank {rank} reported room {room} in non-final state {state}")
        v = self._rooms.get(room)
        if v is None or rank in v.outcomes:
            return False
        v.outcomes[rank] = (state, reason)
        first = False
        if state is TransferState.FAILED and v.failure is None:
            v.failure = f"prefill TP rank {rank}: {reason}"
            first = True
        if len(v.outcomes) == self.tp_size:
            self._finished[room] = None
        return first

    def rank_gone(self, rank: int, reason: str) -> list[int]:
        """Rank `rank` exited: it fails every room it has not reported. Returns the rooms that
        failed for the first time because of it."""
        if rank in self.gone:
            return []
        self.gone[rank] = reason
        return [room for room in list(self._rooms) if self.report(rank, room, TransferState.FAILED, reason)]

    def failure(self, room: int) -> str | None:
        """Why the room failed (the first failure heard), or None while no rank failed it."""
        v = self._rooms.get(room)
        return None if v is None else v.failure

    def pending_ranks(self, room: int) -> list[int]:
        """Ranks that have not reported `room` yet (for logs and errors)."""
        v = self._rooms.get(room)
        return [] if v is None else [r for r in range(self.tp_size) if r not in v.outcomes]

    def take_finished(self) -> list[tuple[int, TransferState, str]]:
        """(room, Success | Failed, reason) of rooms every rank reported; each once, then forgotten."""
        out = []
        for room in self._finished:
            v = self._rooms.pop(room)
            out.append(
                (room, TransferState.FAILED, v.failure) if v.failure is not None else (room, TransferState.SUCCESS, "")
            )
        self._finished.clear()
        return out
