"""The soak's judgement of how each request ended, and their tally and checks (pure).

A soak accepts three ends: a success, a clear error (an HTTP status or an abort, with the
server's message) and our own disconnect. An end without a result or a message (a dropped
connection, no [DONE], a wrong token count, ...) is unclear, and no final status by the deadline
is a hang: both fail the soak.
"""

from __future__ import annotations

import collections
import enum
from typing import Any

from kvpipe.harness.latency import percentiles
from kvpipe.harness.outcome import End, Outcome
from kvpipe.qa.checks import Check


class Judgement(enum.Enum):
    SUCCESS = "success"  # finished normally with the asked token count
    ERROR = "error"  # a clear error: HTTP status + message, or an abort finish reason with a message
    DISCONNECTED = "disconnected"  # we closed the stream on purpose
    UNCLEAR = "unclear"  # ended without a result or a message (dropped connection, no [DONE], ...)
    HANG = "hang"  # neither finished nor failed by its deadline

    @property
    def acceptable(self) -> bool:
        return self in (Judgement.SUCCESS, Judgement.ERROR, Judgement.DISCONNECTED)


def judge(o: Outcome) -> Judgement:
    if o.end is End.OK:
        return Judgement.SUCCESS
    if o.end in (End.HTTP_ERROR, End.ABORT):
        return Judgement.ERROR if o.message else Judgement.UNCLEAR
    if o.end is End.DISCONNECTED:
        return Judgement.DISCONNECTED
    if o.end is End.TIMEOUT:
        return Judgement.HANG
    return Judgement.UNCLEAR


class Tally:
    """Outcomes by request index; every planned request must end up here exactly once."""

    def __init__(self) -> None:
        self._by_index: dict[int, tuple[Outcome, Judgement]] = {}
        self.duplicates: list[int] = []

    def add(self, o: Outcome) -> None:
        if o.index in self._by_index:
            self.duplicates.append(o.index)
        self._by_index[o.index] = (o, judge(o))

    @property
    def outcomes(self) -> list[Outcome]:
        return [self._by_index[i][0] for i in sorted(self._by_index)]

    def by_outcome(self) -> dict[str, int]:
        c = collections.Counter(j for _, j in self._by_index.values())
        return {j.value: c.get(j, 0) for j in Judgement}

    def by_kind(self) -> dict[str, dict[str, int]]:
        """api[+stream] -> judgement -> count, e.g. "chat/stream" -> {"success": 3, ...}."""
        out: dict[str, dict[str, int]] = {}
        for o, j in self._by_index.values():
            key = f"{o.request.api.value}/{'stream' if o.request.stream else 'plain'}"
            row = out.setdefault(key, {k.value: 0 for k in Judgement})
            row[j.value] += 1
        return dict(sorted(out.items()))

    def latency_ms(self) -> dict[str, dict[str, float | None]]:
        """judgement -> p50/p90 of send-to-final-status in ms (judgements that occurred)."""
        out: dict[str, dict[str, float | None]] = {}
        for j in Judgement:
            vals = [o.latency_s * 1e3 for o, k in self._by_index.values() if k is j and o.latency_s is not None]
            if vals:
                p = percentiles(vals, (50, 90))
                out[j.value] = {"p50": p[50], "p90": p[90], "n": len(vals)}
        return out

    def messages(self, limit: int = 10) -> list[dict[str, Any]]:
        """The most common (judgement, status, reason) of the non-successes, with counts."""
        quiet = (Judgement.SUCCESS, Judgement.DISCONNECTED)
        c = collections.Counter(
            (j.value, o.http_status, _shorten(o.reason)) for o, j in self._by_index.values() if j not in quiet
        )
        return [{"outcome": j, "status": s, "message": m, "count": n} for (j, s, m), n in c.most_common(limit)]

    def checks(self, planned: int, faults_injected: bool) -> list[Check]:
        counts = self.by_outcome()
        missing = planned - len(self._by_index)
        server_errors = sum(
            1 for o, _ in self._by_index.values() if o.end is End.HTTP_ERROR and (o.http_status or 0) >= 500
        )
        return [
            Check(
                "every request accounted",
                missing == 0 and not self.duplicates,
                f"{len(self._by_index)}/{planned} with a final status, {len(self.duplicates)} duplicates",
            ),
            Check("no hangs", counts[Judgement.HANG.value] == 0, f"{counts[Judgement.HANG.value]} hung"),
            Check(
                "every failure is clear",
                counts[Judgement.UNCLEAR.value] == 0,
                f"{counts[Judgement.UNCLEAR.value]} ended without a status or message",
            ),
            # with no injected faults a 5xx is a server bug; with them, the injected transfer
            # failures may surface as 500s (the prefill's answer, passed on by the router)
            Check(
                "no 5xx without injected faults",
                faults_injected or server_errors == 0,
                f"{server_errors} 5xx responses" + (" (faults injected)" if faults_injected else ""),
            ),
        ]


def _shorten(msg: str, n: int = 160) -> str:
    return msg if len(msg) <= n else msg[:n] + "..."
