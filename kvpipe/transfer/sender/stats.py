"""What a prefill rank's sender counts (`SenderStats`, read by /metrics and the benchmarks) and how
a room that succeeded used the link (`TransferTiming`, read by the layer pipeline and timelines)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SenderStats:
    rejected_messages: int = 0  # invalid RegisterPeer / TransferRequest / Abort, answered or dropped
    batches_submitted: int = 0
    batches_failed: int = 0
    ops_submitted: int = 0
    bytes_written: int = 0
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    # Link goodput = busy_bytes / busy_s: seconds with at least one batch in flight and the bytes
    # those batches landed, counted over finished busy periods only (the two always agree).
    busy_s: float = 0.0
    busy_bytes: int = 0
    staged_chunks: int = 0  # staged chunks the decode scattered
    staged_bytes: int = 0
    auth_rejected: int = 0  # control frames the rank's endpoint dropped (no valid tag, stale, replayed)
    foreign_rejected: int = 0  # staging grants / dones not from the chunk's agent session or without its nonce
    orphans_refused: int = 0  # requests refused: their session had max_orphan_rooms_per_session waiting
    tombstones_evicted: int = 0  # a session's oldest tombstones forgotten past max_tombstones_per_session


@dataclass(frozen=True)
class TransferTiming:
    """How a room that succeeded used the link (sender clock, seconds)."""

    room: int
    nbytes: int  # bytes written to every destination
    busy_s: float  # seconds with at least one of its batches in flight
    first_submit_at: float | None
    last_done_at: float | None
    requested_at: float | None = None  # the decode's page tables (all its ranks') had arrived
    busy_spans: tuple[tuple[float, float], ...] = ()  # (start, end) of each stretch of writes in flight
