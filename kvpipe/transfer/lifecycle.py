"""Per-room transfer state, deadlines and peer liveness: plain Python, driven by an injected clock.

Both sides track each request ("room") through

    Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed

States only move forward and Failed wins over everything (also over Success: a late failure of a
room whose result was not yet handed to the engine must not be hidden). Every non-terminal state
may carry a deadline; `RoomRecord.expire(now)` fails a room whose deadline passed.

Meaning per side:
- prefill (KVSender): Bootstrapping = admitted, the decode's TransferRequest not yet here;
  WaitingForInput = destination known, no KV sent yet; Transferring = writes submitted.
- decode (KVReceiver): Bootstrapping = fetching the prefill's layout / registering;
  WaitingForInput = TransferRequest sent; Transferring = a prefill rank reported progress.

A Failed room is not necessarily safe to free: writes may still be in flight, and a page reused
under a landing write corrupts its new owner's KV.
On decode, `ReceiverRoom.quiet_deadline` bounds how long it waits for that to settle.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvpipe.config import DisaggregationConfig

Clock = Callable[[], float]


class DuplicateRoomError(ValueError):
    """add_room for a room that is still active: the engine must reject the new request only."""


class TransferState(enum.IntEnum):
    # The order is the forward direction of the state machine.
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= TransferState.SUCCESS


def advance(cur: TransferState, new: TransferState) -> TransferState:
    """The state after `cur` receives `new`: never backwards, Failed is absorbing and wins."""
    if cur is TransferState.FAILED or new is TransferState.FAILED:
        return TransferState.FAILED
    return max(cur, new)


Timeouts = Mapping[TransferState, float | None]


def sender_timeouts(cfg: DisaggregationConfig) -> dict[TransferState, float | None]:
    # WaitingForInput / Transferring on prefill wait for the engine's own compute; a stuck write
    # batch is bounded separately (transfer_timeout_s without progress).
    return {
        TransferState.BOOTSTRAPPING: cfg.bootstrap_timeout_s,
        TransferState.WAITING_FOR_INPUT: None,
        TransferState.TRANSFERRING: None,
    }


def receiver_timeouts(cfg: DisaggregationConfig) -> dict[TransferState, float | None]:
    return {
        TransferState.BOOTSTRAPPING: cfg.bootstrap_timeout_s,
        TransferState.WAITING_FOR_INPUT: cfg.waiting_timeout_s,
        TransferState.TRANSFERRING: cfg.waiting_timeout_s,
    }


@dataclass
class RoomRecord:
    """State, reason and deadline of one room on one side."""

    room: int
    timeouts: Timeouts
    created_at: float
    state: TransferState = TransferState.BOOTSTRAPPING
    reason: str = ""  # why it failed (first reason wins)
    deadline: float | None = None  # when the current non-terminal state expires
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self._arm(self.created_at)

    @classmethod
    def new(cls, room: int, timeouts: Timeouts, now: float) -> RoomRecord:
        return cls(room=room, timeouts=timeouts, created_at=now)

    def _arm(self, now: float) -> None:
        t = None if self.state.terminal else self.timeouts.get(self.state)
        self.deadline = None if t is None else now + t

    def move(self, new: TransferState, now: float, reason: str = "") -> bool:
        """Apply `new`; re-arm the deadline on a state change. Returns True if the state changed."""
        nxt = advance(self.state, new)
        if nxt is self.state:
            return False
        self.state = nxt
        if nxt is TransferState.FAILED and not self.reason:
            self.reason = reason or "failed"
        if nxt.terminal:
            self.finished_at = now
        self._arm(now)
        return True

    def fail(self, reason: str, now: float) -> bool:
        return self.move(TransferState.FAILED, now, reason)

    def refresh(self, now: float) -> None:
        """Progress was made: restart the current state's deadline."""
        self._arm(now)

    def expire(self, now: float, detail: str = "") -> bool:
        """Fail the room if its deadline passed (`detail` says what was awaited). Returns True if
        it failed now."""
        if self.deadline is None or now < self.deadline:
            return False
        return self.fail(
            f"{self.state.name.lower()} timed out after {self.timeouts.get(self.state)}s"
            + (f": {detail}" if detail else ""),
            now,
        )


# how a side names a peer (a decode's control address, a prefill rank's session id)
PeerKey = TypeVar("PeerKey", bound=Hashable)


@dataclass
class PeerLiveness(Generic[PeerKey]):
    """Last time each peer was heard from; a peer silent past `timeout_s` is dead.

    Any message counts as a sign of life, not only heartbeats. A dead peer is reported once by
    `reap`; if it speaks again it is alive again (`seen` returns True for that revival).
    """

    timeout_s: float
    last_seen: dict[PeerKey, float] = field(default_factory=dict)
    dead: set[PeerKey] = field(default_factory=set)
    observed_at: float | None = None  # when the observer's worker last looked (observed())

    def seen(self, peer: PeerKey, now: float) -> bool:
        """Record a sign of life. Returns True when a peer reported dead came back."""
        self.last_seen[peer] = now
        if peer in self.dead:
            self.dead.discard(peer)
            return True
        return False

    def track(self, peer: PeerKey, now: float) -> None:
        """Start watching a peer we expect to hear from (grace period starts now)."""
        if peer not in self.last_seen:
            self.last_seen[peer] = now

    def forget(self, peer: PeerKey) -> None:
        self.last_seen.pop(peer, None)
        self.dead.discard(peer)

    def alive(self, peer: PeerKey) -> bool:
        return peer in self.last_seen and peer not in self.dead

    def all_dead(self) -> bool:
        """Peers are known and every one of them is dead (none known: False)."""
        return bool(self.last_seen) and len(self.dead) >= len(self.last_seen)

    def observed(self, now: float, pause_after_s: float) -> None:
        """The observer's worker is looking now (called by the real-time thread before `reap`, not
        by the books, whose tests step a simulated clock): a gap since its last look longer than
        `pause_after_s` was its own pause, credited to every peer."""
        if self.observed_at is not None and now - self.observed_at > pause_after_s:
            self.pause(now - self.observed_at, now)
        self.observed_at = now

    def pause(self, gap_s: float, now: float) -> None:
        """The observer itself did not run for `gap_s` (its process starved of CPU, or its worker
        held up): nothing it could have heard in that time counts against a peer, so every peer
        gets the gap back (never past `now`). Without this, a worker that wakes before the receive
        thread has read the heartbeats queued meanwhile would declare every peer dead."""
        for p, t in self.last_seen.items():
            self.last_seen[p] = min(t + gap_s, now)

    def reap(self, now: float) -> list[PeerKey]:
        """Peers that became dead since the last call (each reported once)."""
        newly = [p for p, t in self.last_seen.items() if p not in self.dead and now - t > self.timeout_s]
        self.dead.update(newly)
        return newly
