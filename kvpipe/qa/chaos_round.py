"""What one round of the kill -9 campaign found."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvpipe.qa.chaos_plan import Phase


@dataclass
class RoundResult:
    round: int
    target: str
    phase: Phase
    killed_pid: int = 0
    phase_reached: bool = False  # the probe got to its phase before the kill (else killed anyway)
    restarted: str = ""  # the part that supervision restarted
    restart_s: float | None = None  # kill -> that part healthy again
    first_success_s: float | None = None  # kill -> a new request through the router succeeded
    serves_again: bool = False  # and the next few succeeded too
    survivors_restarted: list[str] = field(default_factory=list)
    inflight: Counter[str] = field(default_factory=Counter)  # status -> count, requests in flight at the kill
    hung: list[str] = field(default_factory=list)  # requests with no final status by the deadline
    leaks: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and self.serves_again
            and not self.survivors_restarted
            and not self.hung
            and not self.leaks
            and self.restart_s is not None
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "target": self.target,
            "phase": self.phase.value,
            "ok": self.ok,
            "killed_pid": self.killed_pid,
            "phase_reached": self.phase_reached,
            "restarted": self.restarted,
            "restart_s": rounded(self.restart_s),
            "first_success_s": rounded(self.first_success_s),
            "serves_again": self.serves_again,
            "survivors_restarted": self.survivors_restarted,
            "inflight": dict(self.inflight),
            "hung": self.hung,
            "leaks": self.leaks,
            "error": self.error,
        }


def rounded(x: float | None) -> float | None:
    """Seconds to the millisecond, for the report."""
    return None if x is None else round(x, 3)
