"""A prefill room's transfer, as phases of its request's timeline (kvpipe/engine/timeline.py).

The sender (TP rank 0, in the engine's process, on time.monotonic) reports each room that
succeeded as a `TransferTiming`; the PrefillConnector hands it here when the room finishes.
"""

from __future__ import annotations

from kvpipe.engine.timeline import Phase, Timeline
from kvpipe.transfer.sender.stats import TransferTiming


def record_transfer(timeline: Timeline, timing: TransferTiming | None) -> None:
    """Bootstrap, and each stretch of the room's writes in flight (one per layer group where the
    link keeps up with the compute): nothing when rank 0 reported no timing."""
    if timing is None:
        return
    if timing.requested_at is not None:
        timeline.mark(Phase.BOOTSTRAPPED, timing.requested_at)
    spans = timing.busy_spans
    if not spans and timing.first_submit_at is not None and timing.last_done_at is not None:
        spans = ((timing.first_submit_at, timing.last_done_at),)
    for start, end in spans:
        timeline.mark(Phase.TRANSFER_START, start)
        timeline.mark(Phase.TRANSFER_DONE, end)
    timeline.transfer_bytes = timing.nbytes
