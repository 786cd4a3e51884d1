"""Where one request's time went: the phases the engine and its connector record (plain Python).

A `Timeline` is owned by its `Req` and written by bookkeeping code only (the engine's step, the
PD connectors' polls), never by tensor code: one `(phase, t)` event per phase, a few per prefill
chunk, nothing per decode token. Times are `time.monotonic()` seconds; the prefill's transfer
events come from the sender's clock, the same clock in the same process (TP rank 0).

`TimelineRecord` is the frozen snapshot that travels with a request's final output; its
`components()` are the disjoint durations the Prometheus histograms observe (server/metrics.py)
and that `meta_info.timeline` and `/debug/requests` show:

- colocated / prefill: queue (arrived -> scheduled), prefill compute (the sum of its chunks'
  forwards; other batches may run between chunks);
- prefill: bootstrap wait (arrived -> the decode's page table for the room reached the sender),
  transfer (first write submitted -> last write done, over its stretches of writes in flight;
  overlaps the compute when layer groups pipeline it), exposed transfer (last chunk's forward
  end -> last write done: what layer pipelining did not hide);
- decode: decode wait (arrived -> its prompt's pages reserved and its KV asked for), KV wait
  (-> the KV and the first token arrived), decoding (-> finished): these three add up to
  finished - arrived.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Phase(enum.Enum):
    ARRIVED = "arrived"  # the engine got the request (add_request)
    SCHEDULED = "scheduled"  # it left the queue: its first prefill batch was scheduled
    FORWARD_START = "forward_start"  # a prefill chunk's forward began (value: the chunk's tokens)
    LAYER_GROUP_DONE = "layer_group_done"  # a layer group's KV stored and handed to the sender (value: its end layer)
    FORWARD_END = "forward_end"  # that chunk's forward ended (value: the chunk's tokens)
    FIRST_TOKEN = "first_token"  # sampled here (colocated, prefill) or arrived with the KV (decode)
    BOOTSTRAPPED = "bootstrapped"  # prefill: the decode's page table for the room reached the sender
    # prefill: a stretch of the room's KV writes in flight began / ended (one stretch per layer group
    # where the link keeps up with the compute; the first start and the last end bound the transfer)
    TRANSFER_START = "transfer_start"
    TRANSFER_DONE = "transfer_done"
    PAGES_RESERVED = "pages_reserved"  # decode: the prompt's pages are reserved, the KV asked for
    KV_ARRIVED = "kv_arrived"  # decode: the KV and the aux data (first token) landed
    FINISHED = "finished"  # the engine finished the request
    RELEASED = "released"  # its pages were held for a transfer and are free now (prefill answers then)


class TimelineEvent(NamedTuple):
    """One phase's time (a NamedTuple: a frozen dataclass costs several times as much to build,
    and every request builds a dozen of these on the engine thread)."""

    phase: Phase
    t: float  # time.monotonic() seconds
    value: int | None = None  # what the phase moved: tokens of a chunk, a layer index, bytes


@dataclass(frozen=True)
class TimelineRecord:
    """A finished (or finishing) request's events, sorted by time, and its per-request counts."""

    events: tuple[TimelineEvent, ...]
    prefix_hit_tokens: int = 0  # prompt tokens this server took from its prefix cache
    transfer_bytes: int | None = None  # prefill: KV bytes written for the request (TP rank 0)

    def first(self, phase: Phase) -> float | None:
        return next((e.t for e in self.events if e.phase is phase), None)

    def last(self, phase: Phase) -> float | None:
        return next((e.t for e in reversed(self.events) if e.phase is phase), None)

    def components(self) -> dict[str, float]:
        """The durations (seconds) this record holds the phases of; see the module docstring."""
        arrived = self.first(Phase.ARRIVED)
        out: dict[str, float] = {}
        if arrived is None:
            return out
        scheduled = self.first(Phase.SCHEDULED)
        if scheduled is not None:
            out["queue"] = scheduled - arrived
        starts = [e.t for e in self.events if e.phase is Phase.FORWARD_START]
        ends = [e.t for e in self.events if e.phase is Phase.FORWARD_END]
        if starts and len(starts) == len(ends):
            out["prefill_compute"] = sum(b - a for a, b in zip(starts, ends))
        boot = self.first(Phase.BOOTSTRAPPED)
        if boot is not None:
            out["bootstrap_wait"] = max(0.0, boot - arrived)
        t0, t1 = self.first(Phase.TRANSFER_START), self.last(Phase.TRANSFER_DONE)
        if t0 is not None and t1 is not None:
            out["transfer"] = t1 - t0
        if t1 is not None and ends:
            out["exposed_transfer"] = max(0.0, t1 - ends[-1])
        reserved, kv = self.first(Phase.PAGES_RESERVED), self.first(Phase.KV_ARRIVED)
        if reserved is not None:
            out["decode_wait"] = reserved - arrived
            if kv is not None:
                out["kv_wait"] = kv - reserved
                finished = self.first(Phase.FINISHED)
                if finished is not None:
                    out["decoding"] = finished - kv
        return out

    def to_json(self) -> dict[str, Any]:
        """`meta_info.timeline`: times in seconds since arrival, plus the arrival's monotonic time
        (comparable across the servers of one host: CLOCK_MONOTONIC is system-wide)."""
        t0 = self.first(Phase.ARRIVED)
        base = t0 if t0 is not None else (self.events[0].t if self.events else 0.0)
        return {
            "arrived_monotonic": base,
            "events": [
                {"phase": e.phase.value, "t": round(e.t - base, 6), **({} if e.value is None else {"value": e.value})}
                for e in self.events
            ],
            "components": {k: round(v, 6) for k, v in self.components().items()},
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "transfer_bytes": self.transfer_bytes,
        }


@dataclass
class Timeline:
    """The events of one live request (owned by its Req, written on the engine thread).

    `enabled` False (--disable-request-metrics): marks are dropped and `record()` is None, so
    nothing downstream (meta_info, /debug/requests, the phase histograms) sees the request."""

    events: list[TimelineEvent] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    transfer_bytes: int | None = None
    enabled: bool = True

    def mark(self, phase: Phase, t: float | None = None, value: int | None = None) -> None:
        if self.enabled:
            self.events.append(TimelineEvent(phase, time.monotonic() if t is None else t, value))

    def has(self, phase: Phase) -> bool:
        return any(e.phase is phase for e in self.events)

    def record(self) -> TimelineRecord | None:
        if not self.enabled:
            return None
        # events from another clock reading (the sender's transfer times) arrive late: sort by time
        # (stable: a chunk's start stays before its end at equal times)
        return TimelineRecord(
            tuple(sorted(self.events, key=lambda e: e.t)), self.prefix_hit_tokens, self.transfer_bytes
        )
