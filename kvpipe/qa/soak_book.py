"""The soak's bookkeeping (pure): request outcomes and their tally, leak checks on the servers'
pools against the warmed-up baseline, resource deltas of their processes, and the verdict.

No I/O here: kvpipe/qa/soak_client.py turns responses into `RequestResult`s,
kvpipe/qa/soak_procs.py reads /proc into `ProcSample`s, kvpipe/qa/soak.py fetches
/server_info and prints.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpipe.bench.latency import percentiles
from kvpipe.qa.soak_plan import Bounds, Kind


class Outcome(enum.Enum):
    SUCCESS = "success"  # finished normally with the asked token count
    ERROR = "error"  # a clear error: HTTP status + message, or an abort finish reason with a message
    DISCONNECTED = "disconnected"  # we closed the stream on purpose
    UNCLEAR = "unclear"  # ended without a result or a message (dropped connection, no [DONE], ...)
    HANG = "hang"  # neither finished nor failed by its deadline

    @property
    def acceptable(self) -> bool:
        return self in (Outcome.SUCCESS, Outcome.ERROR, Outcome.DISCONNECTED)


@dataclass(frozen=True)
class RequestResult:
    index: int
    kind: Kind
    stream: bool
    prompt_len: int
    outcome: Outcome
    latency_s: float | None  # send -> final status (None: never sent)
    status: int | None = None  # HTTP status (None: no response)
    message: str = ""  # the error message, or why the result is unclear


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str  # measured value against the bound, for people


class Tally:
    """Results by index; every planned request must end up here exactly once."""

    def __init__(self) -> None:
        self._by_index: dict[int, RequestResult] = {}
        self.duplicates: list[int] = []

    def add(self, r: RequestResult) -> None:
        if r.index in self._by_index:
            self.duplicates.append(r.index)
        self._by_index[r.index] = r

    @property
    def results(self) -> list[RequestResult]:
        return [self._by_index[i] for i in sorted(self._by_index)]

    def by_outcome(self) -> dict[str, int]:
        c = collections.Counter(r.outcome for r in self._by_index.values())
        return {o.value: c.get(o, 0) for o in Outcome}

    def by_kind(self) -> dict[str, dict[str, int]]:
        """kind[+stream] -> outcome -> count, e.g. "chat/stream" -> {"success": 3, ...}."""
        out: dict[str, dict[str, int]] = {}
        for r in self._by_index.values():
            key = f"{r.kind.value}/{'stream' if r.stream else 'plain'}"
            row = out.setdefault(key, {o.value: 0 for o in Outcome})
            row[r.outcome.value] += 1
        return dict(sorted(out.items()))

    def latency_ms(self) -> dict[str, dict[str, float | None]]:
        """outcome -> p50/p90 of send-to-final-status in ms (outcomes that occurred)."""
        out = {}
        for o in Outcome:
            vals = [r.latency_s * 1e3 for r in self._by_index.values() if r.outcome is o and r.latency_s is not None]
            if vals:
                p = percentiles(vals, (50, 90))
                out[o.value] = {"p50": p[50], "p90": p[90], "n": len(vals)}
        return out

    def messages(self, limit: int = 10) -> list[dict[str, Any]]:
        """The most common (outcome, status, message) of the non-successes, with counts."""
        quiet = (Outcome.SUCCESS, Outcome.DISCONNECTED)
        c = collections.Counter(
            (r.outcome.value, r.status, _shorten(r.message)) for r in self._by_index.values() if r.outcome not in quiet
        )
        return [{"outcome": o, "status": s, "message": m, "count": n} for (o, s, m), n in c.most_common(limit)]

    def checks(self, planned: int, faults_injected: bool) -> list[Check]:
        counts = self.by_outcome()
        missing = planned - len(self._by_index)
        server_errors = sum(1 for r in self._by_index.values() if r.status is not None and r.status >= 500)
        return [
            Check(
                "every request accounted",
                missing == 0 and not self.duplicates,
                f"{len(self._by_index)}/{planned} with a final status, {len(self.duplicates)} duplicates",
            ),
            Check("no hangs", counts[Outcome.HANG.value] == 0, f"{counts[Outcome.HANG.value]} hung"),
            Check(
                "every failure is clear",
                counts[Outcome.UNCLEAR.value] == 0,
                f"{counts[Outcome.UNCLEAR.value]} ended without a status or message",
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


# ---- pools: what every request holds while it runs must be back once idle -------------------------
# (path in an internal_states entry, rule): "zero" must be 0, "full" free_pages == total_pages,
# "baseline" back at its warmed-up value. Paths missing from the baseline are not checked.
POOL_RULES: tuple[tuple[str, str], ...] = (
    ("num_running", "zero"),
    ("num_waiting", "zero"),
    ("num_reserved", "zero"),  # decode: pages reserved for an incoming transfer
    ("num_held", "zero"),  # prefill: finished requests whose pages a transfer still reads
    ("free_pages", "full"),
    ("disaggregation.active_rooms", "zero"),
    ("disaggregation.transfer_rooms", "zero"),  # rooms the transfer layer's book still holds
    ("disaggregation.staging_ring.live_slots", "baseline"),
    ("disaggregation.staging_ring.used_bytes", "baseline"),
    ("disaggregation.staging_ring.waiting", "baseline"),
)


def lookup(stats: Mapping[str, Any], path: str) -> Any:
    cur: Any = stats
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def pool_checks(server: str, baseline: Mapping[str, Any], now: Mapping[str, Any]) -> list[Check]:
    """The pools of one server (its /server_info internal_states[0]) against its baseline."""
    out = []
    for path, rule in POOL_RULES:
        base = lookup(baseline, path)
        if base is None:
            continue
        val = lookup(now, path)
        if rule == "zero":
            ok, want = val == 0, "0"
        elif rule == "full":
            total = lookup(now, "total_pages")
            ok, want = val is not None and val == total, f"total_pages {total}"
        else:
            ok, want = val == base, f"baseline {base}"
        out.append(Check(f"{server} {path}", ok, f"{val} (want {want})"))
    return out


def room_deltas(baseline: Mapping[str, Any], final: Mapping[str, Any]) -> dict[str, int | None]:
    """Transfer rooms that succeeded / failed during the run (the injected failures show here even
    when the router retried them away from the client)."""
    out: dict[str, int | None] = {}
    for key in ("rooms_succeeded", "rooms_failed"):
        b, f = lookup(baseline, f"disaggregation.{key}"), lookup(final, f"disaggregation.{key}")
        out[key] = f - b if isinstance(b, int) and isinstance(f, int) else None
    return out


# ---- processes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcSample:
    """One server's process group at one time: summed over its processes (TP ranks included)."""

    t_s: float  # seconds since the soak started
    rss_kb: int
    fds: int
    threads: int
    procs: int

    def as_row(self) -> list[float]:
        return [round(self.t_s, 2), round(self.rss_kb / 1024, 1), self.fds, self.threads, self.procs]


SERIES_COLUMNS = ["t_s", "rss_mb", "fds", "threads", "procs"]


@dataclass
class ResourceSeries:
    """Samples of one server: `baseline` after warm-up, `during` the run, `final` once idle."""

    baseline: ProcSample | None = None
    during: list[ProcSample] = field(default_factory=list)
    final: ProcSample | None = None

    def deltas(self) -> dict[str, float] | None:
        if self.baseline is None or self.final is None:
            return None
        b, f = self.baseline, self.final
        peak = max([s.rss_kb for s in self.during] + [b.rss_kb, f.rss_kb])
        # growth over the run's second half: a per-request leak keeps growing there, while the
        # allocators' high-water steps mostly come early
        mid = self.during[len(self.during) // 2].rss_kb if self.during else b.rss_kb
        return {
            "rss_mb": round((f.rss_kb - b.rss_kb) / 1024, 1),
            "peak_rss_growth_mb": round((peak - b.rss_kb) / 1024, 1),
            "rss_second_half_mb": round((f.rss_kb - mid) / 1024, 1),
            "fds": f.fds - b.fds,
            "threads": f.threads - b.threads,
            "procs": f.procs - b.procs,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "columns": SERIES_COLUMNS,
            "baseline": self.baseline.as_row() if self.baseline else None,
            "during": [s.as_row() for s in self.during],
            "final": self.final.as_row() if self.final else None,
            "deltas": self.deltas(),
        }


def resource_checks(server: str, series: ResourceSeries, bounds: Bounds) -> list[Check]:
    d = series.deltas()
    if d is None:
        return [Check(f"{server} resources sampled", False, "no baseline or final sample (process gone?)")]
    return [
        Check(
            f"{server} RSS growth",
            d["rss_mb"] < bounds.rss_growth_mb,
            f"{d['rss_mb']:+.1f} MB (bound < {bounds.rss_growth_mb:g} MB)",
        ),
        # one-sided: fewer fds than the baseline is the router's idle keep-alive connections closing
        # (a 2,000-request run ended 9 below), not a leak
        Check(f"{server} open fds", d["fds"] <= bounds.fd_delta, f"{d['fds']:+d} (bound +{bounds.fd_delta})"),
        Check(
            f"{server} threads",
            d["threads"] <= bounds.thread_delta,
            f"{d['threads']:+d} (bound +{bounds.thread_delta})",
        ),
        Check(f"{server} processes", d["procs"] == 0, f"{d['procs']:+d}"),
    ]


def verdict(checks: Iterable[Check]) -> bool:
    return all(c.ok for c in checks)


def checks_dict(checks: Sequence[Check]) -> list[dict[str, Any]]:
    return [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]
