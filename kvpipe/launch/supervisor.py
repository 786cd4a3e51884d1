"""Restart bookkeeping for `kvpipe launch`: when a part of the stack may restart, and after how long.

No processes here, only a clock the caller passes in (`now`, seconds, monotonic), so the policy is
unit-tested without starting anything; start.py does the spawning and health checks.

A part that exits is restarted after a backoff that doubles with each restart still inside the
window (1 s, 2 s, 4 s, ... up to the cap), so a part that keeps crashing does not spin, and one
that was fine for a whole window starts again at the initial backoff. More than `max_restarts`
exits inside the window and the part is FAILED: the launcher stops the stack instead of looping.
A restarted part counts as up only once it answers its health check.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum


class PartState(Enum):
    UP = "up"  # running (and healthy, once it started)
    BACKOFF = "backoff"  # exited; waits for its restart time
    STARTING = "starting"  # restarted, not yet healthy
    FAILED = "failed"  # exited more often than the policy allows: the stack stops


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # per part within `window_s`; 0: never restart (one exit stops the stack)
    window_s: float = 300.0
    backoff_s: float = 1.0  # before the first restart in a window; doubles with each further one
    backoff_max_s: float = 30.0
    start_timeout_s: float = 300.0  # a restarted part not healthy by then is killed (another exit)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.start_timeout_s <= 0:
            raise ValueError(f"invalid restart policy: {self}")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(f"backoff cap {self.backoff_max_s} s is below the initial backoff {self.backoff_s} s")

    def delay_s(self, recent: int) -> float:
        """Backoff before a restart when `recent` restarts already happened inside the window."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** min(recent, 62))


@dataclass(frozen=True)
class RestartEvent:
    """One exit of a part and what followed; `up_after_s` is set once the restarted part is healthy."""

    part: str
    number: int  # this part's restarts so far, this one included
    exit_code: int | None
    exited_at: float
    delay_s: float
    pid: int | None = None  # of the restarted process
    up_after_s: float | None = None  # exit -> healthy again (backoff + start)

    def as_dict(self) -> dict:
        return {
            "part": self.part,
            "number": self.number,
            "exit_code": self.exit_code,
            "delay_s": self.delay_s,
            "pid": self.pid,
            "up_after_s": None if self.up_after_s is None else round(self.up_after_s, 3),
        }


@dataclass
class PartTracker:
    """The restart state of one part."""

    name: str
    policy: RestartPolicy
    state: PartState = PartState.UP
    restarts: int = 0  # over the stack's life
    due_at: float = 0.0  # BACKOFF: when to restart
    started_at: float = 0.0  # STARTING: when the new process was spawned
    recent: deque[float] = field(default_factory=deque)  # exit times of restarts inside the window
    events: list[RestartEvent] = field(default_factory=list)

    def exited(self, now: float, exit_code: int | None) -> str:
        """The part's process is gone: schedule a restart (BACKOFF) or give up (FAILED). Returns
        the line to log."""
        if self.state not in (PartState.UP, PartState.STARTING):
            raise RuntimeError(f"{self.name} exited while {self.state.value}")
        while self.recent and now - self.recent[0] > self.policy.window_s:
            self.recent.popleft()
        how = f"{self.name} exited ({_code(exit_code)})"
        if len(self.recent) >= self.policy.max_restarts:
            self.state = PartState.FAILED
            if self.policy.max_restarts == 0:
                return f"{how}; restarts are off: stopping the stack"
            return (
                f"{how}: {len(self.recent) + 1} exits within {self.policy.window_s:g} s, more than the "
                f"{self.policy.max_restarts} restarts allowed: giving up, stopping the stack"
            )
        delay = self.policy.delay_s(len(self.recent))
        self.recent.append(now)
        self.restarts += 1
        self.state, self.due_at = PartState.BACKOFF, now + delay
        self.events.append(RestartEvent(self.name, self.restarts, exit_code, now, delay))
        return (
            f"{how}; restart {len(self.recent)}/{self.policy.max_restarts} in this "
            f"{self.policy.window_s:g} s window in {delay:g} s (same command, same ports)"
        )

    def restart_due(self, now: float) -> bool:
        return self.state is PartState.BACKOFF and now >= self.due_at

    def spawned(self, now: float, pid: int) -> None:
        if self.state is not PartState.BACKOFF:
            raise RuntimeError(f"{self.name} spawned while {self.state.value}")
        self.state, self.started_at = PartState.STARTING, now
        self.events[-1] = replace(self.events[-1], pid=pid)

    def start_timed_out(self, now: float) -> bool:
        return self.state is PartState.STARTING and now - self.started_at > self.policy.start_timeout_s

    def healthy(self, now: float) -> str:
        """The restarted part answers its health check: it is up again. Returns the line to log."""
        if self.state is not PartState.STARTING:
            raise RuntimeError(f"{self.name} became healthy while {self.state.value}")
        ev = self.events[-1]
        self.events[-1] = ev = replace(ev, up_after_s=now - ev.exited_at)
        self.state = PartState.UP
        return f"{self.name} is back up (pid {ev.pid}), {ev.up_after_s:.1f} s after it exited"


def _code(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"


class Supervisor:
    """PartTrackers of a stack's parts, by name, sharing one policy."""

    def __init__(self, names: list[str], policy: RestartPolicy) -> None:
        self.policy = policy
        self.parts = {n: PartTracker(n, policy) for n in names}

    def __getitem__(self, name: str) -> PartTracker:
        return self.parts[name]

    @property
    def failed(self) -> list[str]:
        return [n for n, t in self.parts.items() if t.state is PartState.FAILED]

    def restarts(self) -> dict[str, int]:
        return {n: t.restarts for n, t in self.parts.items()}

    def events(self) -> list[RestartEvent]:
        return sorted((e for t in self.parts.values() for e in t.events), key=lambda e: e.exited_at)

    def summary(self) -> str:
        return "restarts: " + ", ".join(f"{n} {c}" for n, c in self.restarts().items())
